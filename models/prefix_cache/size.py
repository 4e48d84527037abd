"""Sizing the prefix cache: bytes per cached token, and the `--prefix-cache-size` grammar."""
from __future__ import annotations

import re

import torch

DEFAULT_SIZE = "auto"  # min(512 MiB, 65536 tokens): safe next to a small GPU's model and on CPU
_AUTO_BYTES, _AUTO_TOKENS = 512 << 20, 65536
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


def bytes_per_token(*, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token across all layers: 2 * layers * Hkv * D * dtype bytes."""
    return 2 * layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def capacity_tokens(size: str | int, per_token: int) -> int:
    """Token rows a size allows: "512MiB", "2GB", "8192tokens", a byte count, "auto"; 0 disables."""
    text = str(size).strip().lower()
    if text == "auto":
        return min(_AUTO_BYTES // per_token, _AUTO_TOKENS)
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"prefix cache size must look like 512MiB, 2GB, 8192tokens or 0, got {size!r}")
    value, unit = float(m.group(1)), m.group(2)
    if unit in ("token", "tokens"):
        return int(value)
    if unit not in _UNITS:
        raise ValueError(f"unknown unit {unit!r} in prefix cache size {size!r}")
    return int(value * _UNITS[unit]) // per_token
