"""A batch's host data (scheduler/packing.py): the runner's marks of a batch, and one host
output per entry from the runner's result."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from scheduler.forming import Entry
from scheduler.packing import marks, split_outputs


def test_split_outputs():
    rows = split_outputs(torch.arange(6.0).reshape(3, 2), 3)
    assert [r.tolist() for r in rows] == [[0, 1], [2, 3], [4, 5]] and rows[0].dtype == np.float32
    scores = split_outputs(np.array([0.5, -1.0]), 2)
    assert scores == [0.5, -1.0] and all(isinstance(x, float) for x in scores)
    ragged = split_outputs([np.zeros((2, 3)), torch.ones(1, 3)], 2)
    assert [r.shape for r in ragged] == [(2, 3), (1, 3)]
    with pytest.raises(RuntimeError):
        split_outputs(torch.zeros(2, 4), 3)


def test_marks_are_none_unless_an_entry_needs_them():
    def entry(all_tokens=False, namespace=b""):
        return Entry(0, [1, 2], 0.0, all_tokens=all_tokens, namespace=namespace)

    assert marks([entry(), entry()]) == (None, None)
    mask, spaces = marks([entry(), entry(all_tokens=True), entry(namespace=b"t")])
    assert mask is not None and mask.dtype == bool and mask.tolist() == [False, True, False]
    assert spaces == [b"", b"", b"t"]


def test_split_outputs_takes_tensors_that_need_detaching():
    x = torch.arange(6.0).reshape(3, 2).requires_grad_()
    rows = split_outputs(x * 2, 3)  # requires grad: numpy() refuses it, the detached copy serves
    assert [r.tolist() for r in rows] == [[0, 2], [4, 6], [8, 10]] and rows[0].dtype == np.float32
