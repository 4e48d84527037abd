"""Many short sequences of mixed lengths share batched calls on the CPU, exactly.

``sdpa_varlen`` groups the short sequences of small runs by prefix length into batched calls
(``short_plan``). Checked against three independent computations: the per-run calls the batched
ones replace, a float64 dense bottom-right-masked softmax per sequence, and transformers' own
model on each sequence alone (the tiny fixture's heads are narrow enough for the batched path).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import models.attention.varlen as attention
from models.attention.varlen import bottom_right_mask, make_meta, sdpa_varlen
from tests.test_model_forward import TOL, _ours, embedding  # noqa: F401 - embedding: a fixture


def _shapes(seed: int) -> tuple[list[int], list[int]]:
    """Compact-style owners (a few prefix lengths, own rows 1..20), plain causal sequences of
    1..30 rows, a long one and a run of equal shapes in between."""
    rng = np.random.default_rng(seed)
    lq, lk = [], []
    for prefix in (0, 7, 7, 23):
        for own in rng.integers(1, 21, 9).tolist():
            lq.append(own)
            lk.append(prefix + own)
    lq += [150, 5, 5, 5, 5, 5]
    lk += [150, 5, 5, 5, 5, 5]
    for n in rng.integers(1, 31, 12).tolist():
        lq.append(n)
        lk.append(n)
    order = rng.permutation(len(lq))
    return [lq[i] for i in order], [lk[i] for i in order]


def _dense64(q, k, v, cq, ck, scale):
    """Each sequence alone: float64 softmax over its bottom-right causal mask."""
    out = torch.empty(q.shape, dtype=torch.float64)
    heads, kv_heads = q.shape[1], k.shape[1]
    for s in range(len(cq) - 1):
        qs = q[cq[s]:cq[s + 1]].double().transpose(0, 1)  # [H, lq, D]
        ks = k[ck[s]:ck[s + 1]].double().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        vs = v[ck[s]:ck[s + 1]].double().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        scores = (qs @ ks.transpose(1, 2)) * scale
        mask = bottom_right_mask(cq[s + 1] - cq[s], ck[s + 1] - ck[s], q.device)
        out[cq[s]:cq[s + 1]] = (scores.masked_fill(~mask, -math.inf).softmax(-1) @ vs).transpose(0, 1)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_short_sequences_batch_exactly(seed, monkeypatch):
    lq, lk = _shapes(seed)
    cq, ck = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 4, 2, 16
    q = torch.randn(int(cq[-1]), heads, dim, generator=gen)
    k = torch.randn(int(ck[-1]), kv_heads, dim, generator=gen)
    v = torch.randn(int(ck[-1]), kv_heads, dim, generator=gen)
    scale = dim ** -0.5
    meta = make_meta(cq, ck, "cpu")
    plan = meta.short
    assert len(plan.buckets) >= 3  # several prefix lengths, causal ones among them
    batched_rows = sum(len(b.q_rows) for b in plan.buckets)
    kept_rows = sum(r[2] * r[3] for r in plan.runs)
    assert batched_rows + kept_rows == cq[-1]  # every query row answered once
    with torch.inference_mode():
        got = sdpa_varlen(q, k, v, meta, scale=scale)
        monkeypatch.setattr(attention, "SHORT_MIN", 10 ** 9)  # the per-run calls only
        per_run = sdpa_varlen(q, k, v, make_meta(cq, ck, "cpu"), scale=scale)
    assert not make_meta(cq, ck, "cpu").short.buckets
    assert (got - per_run).abs().max().item() < 1e-5
    assert (got.double() - _dense64(q, k, v, cq, ck, scale)).abs().max().item() < 1e-5


def test_wide_heads_keep_their_own_calls(monkeypatch):
    """Where a row is wider than SHORT_WIDTH the batched call is never taken."""
    lq, lk = _shapes(0)
    cq, ck = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    calls = []
    monkeypatch.setattr(attention, "_short_buckets", lambda *a, **kw: calls.append(1))
    heads, kv_heads = 4, 2
    dim = attention.SHORT_WIDTH // (heads + 2 * kv_heads) + 1
    q = torch.randn(int(cq[-1]), heads, dim)
    k, v = torch.randn(2, int(ck[-1]), kv_heads, dim)
    with torch.inference_mode():
        sdpa_varlen(q, k, v, make_meta(cq, ck, "cpu"), scale=0.1)
    assert not calls


@pytest.mark.parametrize("mode", ["off", "compact"])
def test_many_short_sequences_match_transformers(embedding, mode, monkeypatch):
    """64 short queries behind a few shared prompts and 16 unrelated short texts, mixed lengths."""
    runner, oracle = embedding
    rng = np.random.default_rng(3)
    prompts = [rng.integers(100, 5000, n).tolist() for n in (6, 11, 17)]
    seqs = [prompts[i % 3] + rng.integers(100, 5000, int(rng.integers(1, 15))).tolist() for i in range(64)]
    seqs += [rng.integers(100, 5000, int(rng.integers(1, 25))).tolist() for _ in range(16)]
    used = []
    real = attention._short_buckets
    monkeypatch.setattr(attention, "_short_buckets", lambda *a, **kw: (used.append(1), real(*a, **kw)))
    for pooling in ("last-token", "mean"):
        got = _ours(runner, seqs, mode, pooling=pooling)
        want = oracle.embed(seqs, pooling)
        assert (got - want).abs().max().item() < TOL, (mode, pooling)
    assert used  # the batched path ran
