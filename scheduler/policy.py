"""The batching policies by name: the one list of their names and the factory of their formers.

``POLICIES`` is the only spelling of the choices ("fifo", "prefix"); the server's config imports
it. Invariant: every name in ``POLICIES`` has a former here, and nothing else does; no former
made here puts more than ``MAX_BATCH_ITEMS`` items in a batch.
"""
from __future__ import annotations

from .forming import Former, PrefixPolicy, form_batch_fifo
from .prefix_forming import PrefixFormer

POLICIES = ("fifo", "prefix")
# Items in one batch, whatever --max-batch-requests says: CUDA attention kernels launch a grid
# with one block row per sequence, and a grid's y and z dimensions stop at 65,535.
MAX_BATCH_ITEMS = 65535


def make_former(
    policy: str, *, max_tokens: int, max_requests: int | None = None, prefix: PrefixPolicy | None = None
) -> Former:
    """The former of ``policy`` (one of ``POLICIES``) under the given budget (at most
    MAX_BATCH_ITEMS items per batch)."""
    max_requests = min(max_requests, MAX_BATCH_ITEMS) if max_requests is not None else MAX_BATCH_ITEMS
    if policy == "fifo":
        return lambda waiting, now: form_batch_fifo(waiting, max_tokens=max_tokens, max_requests=max_requests)
    if policy == "prefix":
        return PrefixFormer(max_tokens=max_tokens, max_requests=max_requests, config=prefix or PrefixPolicy())
    raise ValueError(f"unknown batching policy {policy!r}; choose one of {POLICIES}")
