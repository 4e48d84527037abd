"""The tree planner's one-owner path (a lone request, its prefix read from the cache) equals the
general planner on the same layout: every field of the plan, tensors included."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from models.attention.tree import TreePlan, _plan_many, _plan_one, plan_tree


def _same(a: TreePlan | None, b: TreePlan | None) -> None:
    assert (a is None) == (b is None)
    if a is None or b is None:
        return
    for f in dataclasses.fields(TreePlan):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "shared":
            assert len(x) == len(y)
            for cx, cy in zip(x, y):
                assert (cx.k0, cx.k1, cx.q0, cx.q1) == (cy.k0, cy.k1, cy.q0, cy.q1)
                assert (cx.q_index is None) == (cy.q_index is None)
                if cx.q_index is not None:
                    assert torch.equal(cx.q_index, cy.q_index)
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert x is not None and y is not None, f.name
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        elif f.name == "estimate":
            assert x == pytest.approx(y, rel=1e-12), f.name
        else:
            assert x == y, f.name


def _layout(rng: np.random.Generator, lq: int, anc: int, *, consecutive: bool, n_read: int):
    """One owner: its ancestors' source rows (pool rows, consecutive or not), then its own rows."""
    if consecutive:
        start = int(rng.integers(0, max(1, n_read - anc + 1)))
        ancestors = start + np.arange(anc, dtype=np.int64)
    else:
        ancestors = np.sort(rng.choice(max(n_read, anc + 2), size=anc, replace=False)).astype(np.int64)
    kv = np.concatenate([ancestors, n_read + np.arange(lq, dtype=np.int64)])
    return np.array([0, lq], np.int64), np.array([0, lq + anc], np.int64), kv


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("consecutive", [True, False])
def test_one_owner_plan_equals_the_general_plan(force: bool, consecutive: bool) -> None:
    rng = np.random.default_rng(7)
    shapes = dict(heads=4, kv_heads=2, head_dim=8, device=torch.device("cpu"), force=force)
    planned = 0
    for _ in range(200):
        lq, anc = int(rng.integers(1, 40)), int(rng.integers(0, 60))
        n_read = anc + int(rng.integers(0, 20))
        cq, ck, kv = _layout(rng, lq, anc, consecutive=consecutive or anc < 2, n_read=n_read)
        one = _plan_one(cq, ck, kv, own_offset=n_read, **shapes)
        many = _plan_many(cq, ck, kv, own_offset=n_read, **shapes)
        _same(one, many)
        _same(plan_tree(cq, ck, kv, own_offset=n_read, **shapes), many)  # the entry point takes it
        planned += one is not None
    assert planned  # the comparison covered plans, not only refusals
