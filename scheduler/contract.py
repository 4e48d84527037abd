"""What the scheduler needs of a model runner: the one contract between scheduler/ and models/.

The scheduler never imports models/. It drives any object with this shape: ``prepare`` on the
prep thread (host work only: pack, trie, tensors), ``run`` on the worker thread (the forward and
one copy to the host, which may still be under way when it returns: ``PendingOutput``). The real implementation is ``models.runner.Runner``; tests implement it
with small fakes. Invariant: the scheduler reads nothing of a runner or a prepared batch that is
not declared here. A type checker holds the scheduler to it, and tests/test_contract.py holds
the real runner and the fakes to it at run time (the Protocols are runtime-checkable).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class Prepared(Protocol):
    """A batch ready for ``run`` and the figures the scheduler reports about it."""

    @property
    def n_tokens(self) -> int:  # N, original tokens of the batch
        ...

    @property
    def n_compact(self) -> int:  # rows the model runs on: N' with the trie, N without
        ...

    @property
    def ratio(self) -> float:  # N'/N of the trie, 1.0 when it was not built
        ...

    @property
    def computed_tokens(self) -> Sequence[int]:  # [B] tokens per item not read from a cache
        ...


@runtime_checkable
class ModelRunner(Protocol):
    """Prepare a packed batch on one thread, run it on another.

    ``input_ids`` int32 [N] and ``cu_seqlens`` int32 [B+1]; ``all_tokens`` is None or a [B] bool
    mask of the items that answer every token's final state; every runner accepts it (the
    scheduler passes None when no item is flagged). ``namespaces``: None, or [B] bytes, each
    item's prefix-cache namespace (b"" the shared one; None when every item is in it); every
    runner accepts it too. ``run`` takes what ``prepare`` returned and
    returns one output per item: an array with a leading [B] axis (numpy, or a torch tensor on the
    host) or a sequence of B outputs of any shapes.
    """

    def prepare(self, input_ids: np.ndarray, cu_seqlens: np.ndarray, *,
                all_tokens: np.ndarray | None = None, namespaces: list[bytes] | None = None) -> Prepared:
        ...

    def run(self, prepared: Any) -> Any:
        ...


@runtime_checkable
class PendingOutput(Protocol):
    """What ``run`` may return instead of its output when the copy to the host is still under way
    (an accelerator): ``result()`` blocks until it is done and returns what ``run`` would have.

    The pipeline calls ``result()`` on its settling thread, so the worker only launches forwards.
    """

    def result(self) -> Any:
        ...
