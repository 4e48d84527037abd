"""A lone CPU sequence's batch reuses its length's layout, and that layout is the general one.

``build_forward_batch`` of one sequence of at most ``LONE_LAYOUT_TOKENS`` tokens on the CPU takes
the positions, attention boundaries, pooling rows and weights built once for its length; only
the ids are its own. The oracle for every field is the general builder (``_plain_batch``), and the
forward of such a batch is held to transformers by tests/test_model_forward.py ("single",
"one-token"). ``pack`` of one entry is held to the general packing of the same entry.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from models import batch as batch_mod
from models.batch import LONE_LAYOUT_TOKENS, build_forward_batch
from scheduler.forming import Entry
from scheduler.packing import pack


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        if a.is_sparse:
            return b.is_sparse and torch.equal(a.to_dense(), b.to_dense())
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("n", [1, 2, 22, LONE_LAYOUT_TOKENS])
@pytest.mark.parametrize("mean_pooling", [False, True])
def test_a_lone_batch_equals_the_general_layout_field_by_field(n, mean_pooling):
    ids = np.random.default_rng(n).integers(0, 1000, n).astype(np.int32)
    cu = np.array([0, n], dtype=np.int32)
    lone = build_forward_batch(ids, cu, None, mode="compact", device="cpu", mean_pooling=mean_pooling)
    general = batch_mod._plain_batch(ids.astype(np.int64), cu.astype(np.int64), torch.device("cpu"), mean_pooling)
    for f in dataclasses.fields(general):
        assert _same(getattr(lone, f.name), getattr(general, f.name)), f.name
    assert lone.input_ids.dtype == torch.int64 and lone.input_ids.tolist() == ids.tolist()


def test_lone_batches_of_one_length_share_the_layout_not_the_ids():
    cu = np.array([0, 5], dtype=np.int32)
    a = build_forward_batch(np.array([1, 2, 3, 4, 5], np.int32), cu)
    b = build_forward_batch(np.array([9, 8, 7, 6, 5], np.int32), cu)
    assert a.positions is b.positions and a.attn is b.attn and a.last_rows is b.last_rows
    assert a.input_ids.tolist() == [1, 2, 3, 4, 5] and b.input_ids.tolist() == [9, 8, 7, 6, 5]
    assert a.input_ids.data_ptr() != b.input_ids.data_ptr()
    layout = batch_mod._lone_layout(5, False)
    assert layout.input_ids.tolist() == [0] * 5  # the shared layout's own ids are never a batch's


def test_longer_or_several_sequences_build_their_own():
    n = LONE_LAYOUT_TOKENS + 1
    cu = np.array([0, n], dtype=np.int32)
    ids = np.arange(n, dtype=np.int32)
    assert build_forward_batch(ids, cu).positions is not build_forward_batch(ids, cu).positions
    two = np.array([0, 2, 5], dtype=np.int32)
    ids5 = np.arange(5, dtype=np.int32)
    assert build_forward_batch(ids5, two).positions is not build_forward_batch(ids5, two).positions


@pytest.mark.parametrize("lengths", [[1], [7], [3, 4], [2, 1, 5]])
def test_pack_of_one_entry_equals_the_general_packing(lengths):
    entries = [Entry(i, list(range(10 * i, 10 * i + n)), 0.0) for i, n in enumerate(lengths)]
    ids, cu = pack(entries)
    assert ids.dtype == np.int32 and cu.dtype == np.int32
    assert ids.tolist() == [t for e in entries for t in e.input_ids]
    assert cu.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
