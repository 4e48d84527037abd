"""The portable attention path against a float64 naive per-sequence reference (bottom-right)."""
from __future__ import annotations

import math

import pytest
import torch

import models.attention as attention
from models.attention import bottom_right_mask, make_meta, sdpa_varlen, select_backend


def naive(q, k, v, cu_q, *, cu_k, scale):
    """float64, one sequence at a time, explicit loops over the bottom-right causal rule."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for s in range(len(cu_q) - 1):
        lq, lk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        for i in range(lq):
            for h in range(q.shape[1]):
                qi = q[cu_q[s] + i, h]
                keys = k[cu_k[s]:cu_k[s] + i + lk - lq + 1, h // group]  # j <= i + lk - lq
                vals = v[cu_k[s]:cu_k[s] + i + lk - lq + 1, h // group]
                w = torch.softmax(keys @ qi * scale, dim=0)
                out[cu_q[s] + i, h] = w @ vals
    return out


@pytest.mark.parametrize("lens", [
    [(5, 9), (3, 8), (7, 7)],  # compact-style: lq < lk, then a full sequence
    [(4, 4), (4, 4), (4, 4)],  # one run of equal shapes (batched call)
    [(1, 6), (1, 6), (2, 2), (1, 1), (6, 6)],  # single-query rows, runs of two
])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_sdpa_varlen_matches_naive_float64(lens, kv_heads):
    gen = torch.Generator().manual_seed(len(lens) * 10 + kv_heads)
    cu_q, cu_k = [0], [0]
    for lq, lk in lens:
        cu_q.append(cu_q[-1] + lq)
        cu_k.append(cu_k[-1] + lk)
    q = torch.randn(cu_q[-1], 4, 8, generator=gen)
    k = torch.randn(cu_k[-1], kv_heads, 8, generator=gen)
    v = torch.randn(cu_k[-1], kv_heads, 8, generator=gen)
    scale = 1 / math.sqrt(8)
    got = sdpa_varlen(q, k, v, make_meta(cu_q, cu_k, q.device), scale=scale)
    want = naive(q, k, v, cu_q, cu_k=cu_k, scale=scale)
    assert got.shape == q.shape
    assert (got.double() - want).abs().max().item() < 1e-5


def test_bottom_right_mask_rule():
    mask = bottom_right_mask(2, 5, torch.device("cpu"))
    want = torch.tensor([[j <= i + 3 for j in range(5)] for i in range(2)])
    assert torch.equal(mask, want)


def test_cpu_selects_portable_backend():
    assert select_backend("cpu").name == "sdpa"
    with pytest.raises(ValueError):
        select_backend("cpu", prefer="flash-attn")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_backend_matches_portable_path(dtype):
    backend = select_backend("cuda", dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    cu_q, cu_k = [0, 3, 10, 11], [0, 12, 19, 30]
    q = torch.randn(11, 8, 64, generator=gen).cuda().to(dtype)
    k = torch.randn(30, 2, 64, generator=gen).cuda().to(dtype)
    v = torch.randn(30, 2, 64, generator=gen).cuda().to(dtype)
    meta = make_meta(cu_q, cu_k, q.device)
    got = backend(q, k, v, meta, scale=0.125).float()
    want = naive(q.float(), k.float(), v.float(), cu_q, cu_k=cu_k, scale=0.125)
    assert (got.double() - want).abs().max().item() < 2e-2


@pytest.mark.parametrize("flavour", ["is_causal-no-scale", "window-scale-gqa"])
def test_torch_varlen_wrapper_follows_the_signature(monkeypatch, flavour):
    """The wrapper passes only the keywords this torch's varlen_attn takes (2.11 vs later)."""
    import sys
    import types

    seen = {}

    def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kw):
        seen.update(kw)
        meta = make_meta(cu_seq_q.tolist(), cu_seq_k.tolist(), query.device)
        if key.shape[1] != query.shape[1]:
            assert kw.get("enable_gqa")
        return sdpa_varlen(query, key, value, meta, scale=kw.get("scale", query.shape[-1] ** -0.5))

    if flavour == "is_causal-no-scale":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                        return_aux=None):
            assert is_causal
            return fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                        scale=None, window_size=(-1, -1), enable_gqa=False):
            assert window_size == (-1, 0)
            kw = {"enable_gqa": enable_gqa} | ({"scale": scale} if scale is not None else {})
            return fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kw)

    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen",
                        types.SimpleNamespace(varlen_attn=varlen_attn))
    fn = attention._torch_varlen_fn()
    assert fn is not None
    gen = torch.Generator().manual_seed(2)
    cu_q, cu_k = [0, 2, 5], [0, 4, 7]
    q = torch.randn(5, 4, 16, generator=gen)
    k, v = torch.randn(7, 2, 16, generator=gen), torch.randn(7, 2, 16, generator=gen)
    meta = make_meta(cu_q, cu_k, q.device)
    got = fn(q, k, v, meta, scale=0.25)  # the default scale for D = 16
    want = naive(q, k, v, cu_q, cu_k=cu_k, scale=0.25)
    assert (got.double() - want).abs().max().item() < 1e-5
    if flavour == "is_causal-no-scale":
        assert "scale" not in seen
        with pytest.raises(ValueError, match="scale"):
            fn(q, k, v, meta, scale=0.1)  # a non-default scale cannot be honoured silently
    else:
        assert seen["scale"] == 0.25
