"""The model-side choices a serving flag selects, and the trie gate's threshold: each rule once.

`load_runner` checks its arguments against these and server/config.py builds its flag choices
and its threshold check from them, so the two can never disagree. Invariant: this module imports
only the standard library (server/config.py imports it when the CLI starts, before torch is needed).
"""
from __future__ import annotations

import re

POOLINGS = ("last-token", "mean", "cls")  # how an embedding model turns token states into one vector
RADIX_ATTENTION = ("compact", "paper")  # attention over the trie's compact rows
# what a runner serves: pooled vectors, one relevance score per (query, document), a score per
# label (classification head), one score per text (a single-score head read as a reward)
KINDS = ("embedding", "reranker", "classifier", "reward")
TREE_ATTENTION = ("auto", "on", "off")  # tree (cascade) attention along the trie: models/attention/tree.py


def check_radix_mlp_threshold(value: float, name: str = "radix_mlp_threshold") -> float:
    """The trie gate's threshold as a float; refused outside [0, 1] (and NaN). `name` says which
    argument or flag held it, for the message."""
    if not 0.0 <= value <= 1.0:  # NOTE: NaN fails every comparison, so it is refused too
        raise ValueError(f"{name} must lie in [0, 1], got {value!r}")
    return float(value)


# The trie's own cost is paid per batch whatever it finds: building it and the batch layout on the
# host, one K/V gather per layer; its gain is the position-wise work (QKV, O, MLP) of the rows it
# removes, which grows with saved rows x hidden size. Below this much saved work a batch runs
# without it. The value is twice the measured break-even (`python -m benchmarks.bench gate`: a
# whole batch, prepare + run, with and without the trie, alternating; hidden 64 broke even near
# 8,192, hidden 1024 gained at a few saved rows), so a tiny forward never pays for the trie: the
# tiny fixtures need 256 saved rows, Qwen3-0.6B 16, Qwen3-8B 4 (docs/decisions.md, "The trie gate").
MIN_SAVED_WORK = 16384


def use_index(threshold: float, ratio: float, *, saved_rows: int, hidden_size: int) -> bool:
    """The trie gate: 0 never (the trie is not even built), 1 always; else iff N'/N < threshold
    and the trie saves at least MIN_SAVED_WORK (saved rows N - N' times the hidden size)."""
    if threshold >= 1.0:
        return True
    if threshold <= 0.0 or ratio >= threshold:
        return False
    return saved_rows * hidden_size >= MIN_SAVED_WORK


# The --prefix-cache-size grammar (models/prefix_cache/size.py turns a size into token rows).
CACHE_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_CACHE_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


def parse_cache_size(size: str | int) -> tuple[float, str] | None:
    """A prefix cache size -> (value, unit): "512MiB" -> (512.0, "mib"), "8192tokens" -> (8192.0,
    "tokens"); "auto" -> None. Raises ValueError on anything else."""
    text = str(size).strip().lower()
    if text == "auto":
        return None
    m = _CACHE_SIZE.match(text)
    if m is None:
        raise ValueError(f"prefix cache size must look like 512MiB, 2GB, 8192tokens or 0, got {size!r}")
    value, unit = float(m.group(1)), m.group(2)
    if unit not in CACHE_SIZE_UNITS and unit not in ("token", "tokens"):
        raise ValueError(f"unknown unit {unit!r} in prefix cache size {size!r}")
    return value, "tokens" if unit == "token" else unit
