"""Attention specs: backends that cannot honour a soft-cap or a window are refused with a reason,
and the backend that honours them matches a per-query reference."""
from __future__ import annotations

import math

import pytest
import torch

from models.attention.varlen import make_meta, sdpa_varlen
from models.attention.select import select_backend
from models.attention.spec import AttentionSpec, spec_varlen
from models.attention.tree_select import select_tree

CU_Q, CU_K = [0, 5, 8, 9, 16], [0, 9, 17, 21, 28]  # lq < lk (compact), a single query, lq == lk


def _qkv(h=4, hkv=2, d=8):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(CU_Q[-1], h, d, generator=gen, dtype=torch.float64),
            torch.randn(CU_K[-1], hkv, d, generator=gen, dtype=torch.float64),
            torch.randn(CU_K[-1], hkv, d, generator=gen, dtype=torch.float64))


def _reference(q, k, v, scale, softcap, window):
    """One query at a time: its visible keys by position, soft-capped logits, softmax."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    for b in range(len(CU_Q) - 1):
        lq, lk = CU_Q[b + 1] - CU_Q[b], CU_K[b + 1] - CU_K[b]
        for i in range(lq):
            pos = i + lk - lq
            keys = [j for j in range(lk) if j <= pos and (window is None or pos - j < window)]
            for hh in range(q.shape[1]):
                qv = q[CU_Q[b] + i, hh]
                logits = [float(qv @ k[CU_K[b] + j, hh // group]) * scale for j in keys]
                if softcap is not None:
                    logits = [softcap * math.tanh(x / softcap) for x in logits]
                w = torch.tensor(logits, dtype=torch.float64).softmax(0)
                out[CU_Q[b] + i, hh] = sum(w[n] * v[CU_K[b] + j, hh // group] for n, j in enumerate(keys))
    return out


@pytest.mark.parametrize("softcap,window", [(None, None), (2.0, None), (None, 3), (1.5, 4)])
def test_spec_varlen_matches_the_reference(softcap, window):
    q, k, v = _qkv()
    meta = make_meta(CU_Q, CU_K, "cpu")
    got = spec_varlen(q, k, v, meta, scale=0.3, softcap=softcap, window=window)
    want = _reference(q, k, v, 0.3, softcap, window)
    assert (got - want).abs().max().item() < 1e-5
    if softcap is None and window is None:  # the plain case agrees with the default backend
        assert (got - sdpa_varlen(q, k, v, meta, scale=0.3)).abs().max().item() < 1e-5
    else:  # and the features have teeth
        assert (got - _reference(q, k, v, 0.3, None, None)).abs().max().item() > 1e-3


def test_selection_refuses_backends_that_cannot_honour_the_spec(caplog):
    spec = AttentionSpec(scale=0.25, softcap=50.0, window=16)
    with caplog.at_level("INFO"):
        backend = select_backend("cpu", dtype=torch.float32, heads=4, kv_heads=2, head_dim=8, spec=spec)
    assert backend.name == "spec-varlen" and {"softcap", "window"} <= backend.honours
    assert "softcap" in backend.rejected["sdpa"] and "window" in backend.rejected["flash-attn"]
    assert "cannot honour" in caplog.text
    plain = select_backend("cpu", dtype=torch.float32, heads=4, kv_heads=2, head_dim=8,
                           spec=AttentionSpec(scale=0.25))
    assert plain.name == "sdpa"
    path, why = select_tree("cpu", dtype=torch.float32, heads=4, kv_heads=2, head_dim=8, spec=spec)
    assert path is None and "softcap" in why["cpu-flash"]


def test_query_blocks_and_key_ranges_change_nothing(monkeypatch):
    """Blocks of 2 queries (keys cut to what each block sees) against one block per sequence."""
    import models.attention.spec as spec_mod

    q, k, v = _qkv()
    meta = make_meta(CU_Q, CU_K, "cpu")
    whole = spec_varlen(q, k, v, meta, scale=0.3, softcap=1.5, window=3)
    monkeypatch.setattr(spec_mod, "QUERY_BLOCK", 2)
    blocked = spec_mod.spec_varlen(q, k, v, meta, scale=0.3, softcap=1.5, window=3)
    assert (whole - blocked).abs().max().item() < 1e-12
    assert (blocked - _reference(q, k, v, 0.3, 1.5, 3)).abs().max().item() < 1e-5
