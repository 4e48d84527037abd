"""The model-side choices a serving flag selects, and the trie gate's threshold: each rule once.

`load_runner` checks its arguments against these and server/config.py builds its flag choices
and its threshold check from them, so the two can never disagree. Invariant: this module imports
nothing (server/config.py imports it when the CLI starts, before torch is needed).
"""
from __future__ import annotations

POOLINGS = ("last-token", "mean", "cls")  # how an embedding model turns token states into one vector
RADIX_ATTENTION = ("compact", "paper")  # attention over the trie's compact rows
KINDS = ("embedding", "reranker")


def check_radix_mlp_threshold(value: float, name: str = "radix_mlp_threshold") -> float:
    """The trie gate's threshold as a float; refused outside [0, 1] (and NaN). `name` says which
    argument or flag held it, for the message."""
    if not 0.0 <= value <= 1.0:  # NOTE: NaN fails every comparison, so it is refused too
        raise ValueError(f"{name} must lie in [0, 1], got {value!r}")
    return float(value)


def use_index(threshold: float, ratio: float) -> bool:
    """The trie gate: 0 never (the trie is not even built), 1 always, else iff N'/N < threshold."""
    return threshold >= 1.0 or (threshold > 0.0 and ratio < threshold)
