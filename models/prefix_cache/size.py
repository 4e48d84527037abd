"""Sizing the prefix cache: bytes per cached token, the `--prefix-cache-size` grammar, and `auto`.

`auto` is what the machine can spare, stated as a rule and reported with its figures:
- on CUDA, AUTO_DEVICE_FRACTION of the device memory free after a forward of the largest batch
  the server forms (its activations stay reserved by the allocator, so what is free then is
  what serving does not need); the rest is headroom for other batch shapes' fragments, the
  serving thread's cuBLAS workspaces and anything else on the GPU;
- on a CPU, AUTO_HOST_FRACTION of the RAM available at start, at most AUTO_HOST_BYTES and
  AUTO_HOST_TOKENS (a CPU forward runs some thousands of tokens a second: a larger cache would
  keep prefixes nobody comes back to in time, and the pool is committed at start).
Invariant: every rule answers (tokens, why) and `why` carries the numbers it used.
"""
from __future__ import annotations

import os

import torch

from models.options import CACHE_SIZE_UNITS, parse_cache_size

DEFAULT_SIZE = "auto"
AUTO_DEVICE_FRACTION = 0.7
AUTO_HOST_FRACTION, AUTO_HOST_BYTES, AUTO_HOST_TOKENS = 0.25, 4 << 30, 65536


def bytes_per_token(*, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token across all layers: 2 * layers * Hkv * D * dtype bytes."""
    return 2 * layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def is_auto(size: str | int) -> bool:
    return str(size).strip().lower() == "auto"


def capacity_tokens(size: str | int, per_token: int) -> int:
    """Token rows a size allows: "512MiB", "2GB", "8192tokens", a byte count; 0 disables.

    "auto" here is the host rule (`auto_host_tokens` with the RAM available now); a CUDA runner
    sizes `auto` with `auto_device_tokens` after its warm-up instead.
    """
    parsed = parse_cache_size(size)
    if parsed is None:
        return auto_host_tokens(per_token, available_host_bytes())[0]
    value, unit = parsed
    if unit == "tokens":
        return int(value)
    return int(value * CACHE_SIZE_UNITS[unit]) // per_token


def auto_host_tokens(per_token: int, available: int) -> tuple[int, str]:
    """CPU `auto`: AUTO_HOST_FRACTION of `available` bytes, capped in bytes and in tokens."""
    budget = min(int(available * AUTO_HOST_FRACTION), AUTO_HOST_BYTES)
    tokens = min(budget // per_token, AUTO_HOST_TOKENS)
    return tokens, (f"auto: {AUTO_HOST_FRACTION:.0%} of {available / 2**30:.2f} GiB RAM available, at most "
                    f"{AUTO_HOST_BYTES / 2**30:.0f} GiB and {AUTO_HOST_TOKENS} tokens")


def auto_device_tokens(per_token: int, free: int, *, warmup_tokens: int, peak: int) -> tuple[int, str]:
    """CUDA `auto`: AUTO_DEVICE_FRACTION of the `free` bytes left after a `warmup_tokens` forward."""
    tokens = int(free * AUTO_DEVICE_FRACTION) // per_token
    return tokens, (f"auto: {AUTO_DEVICE_FRACTION:.0%} of {free / 2**30:.2f} GiB device memory free after a "
                    f"{warmup_tokens}-token forward (peak allocated {peak / 2**30:.2f} GiB)")


def available_host_bytes() -> int:
    """RAM available to new allocations (MemAvailable), or the free pages where that is unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
