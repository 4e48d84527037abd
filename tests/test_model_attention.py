"""The portable attention paths against a float64 naive per-sequence reference (bottom-right),
and the backend choice: probe shapes, the report of rejected backends, their WARNING lines."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import logging

import models.attention.select as attention_select
from models.attention.varlen import (MAX_PAD_FACTOR, bottom_right_mask, make_meta, sdpa_padded,
                              sdpa_varlen)
from models.attention.select import Shape, probe, select_backend


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
@pytest.mark.parametrize("fn", [sdpa_varlen, sdpa_padded], ids=["sdpa", "sdpa-padded"])
def test_portable_paths_match_naive_float64(lens, kv_heads, fn):
    gen = torch.Generator().manual_seed(len(lens) * 10 + kv_heads)
    cu_q, cu_k = [0], [0]
    for lq, lk in lens:
        cu_q.append(cu_q[-1] + lq)
        cu_k.append(cu_k[-1] + lk)
    q = torch.randn(cu_q[-1], 4, 8, generator=gen)
    k = torch.randn(cu_k[-1], kv_heads, 8, generator=gen)
    v = torch.randn(cu_k[-1], kv_heads, 8, generator=gen)
    scale = 1 / math.sqrt(8)
    got = fn(q, k, v, make_meta(cu_q, cu_k, q.device), scale=scale)
    want = naive(q, k, v, cu_q, cu_k=cu_k, scale=scale)
    assert got.shape == q.shape
    assert (got.double() - want).abs().max().item() < 1e-5


def test_bottom_right_mask_rule():
    mask = bottom_right_mask(2, 5, torch.device("cpu"))
    want = torch.tensor([[j <= i + 3 for j in range(5)] for i in range(2)])
    assert torch.equal(mask, want)


def test_cpu_selects_portable_backend_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="models.attention.select"):
        backend = select_backend("cpu", dtype=torch.float32, heads=4, kv_heads=2, head_dim=16)
    assert backend.name == "sdpa"
    assert set(backend.rejected) == {"flash-attn", "torch-varlen", "torch-varlen-repeat-kv",
                                     "efficient-varlen", "sdpa-padded"}
    assert "needs CUDA" in backend.rejected["flash-attn"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # nothing failed


def _top_left_causal(q, k, v, meta, *, scale):
    """A plausible bug: causal mask aligned top-left (right only when lq == lk)."""
    outs = []
    for s in range(len(meta.host_cu_seqlens_q) - 1):
        q0, q1 = meta.host_cu_seqlens_q[s:s + 2]
        k0, k1 = meta.host_cu_seqlens_k[s:s + 2]
        group = q.shape[1] // k.shape[1]
        qs = q[q0:q1].transpose(0, 1)  # [H, lq, D]
        ks = k[k0:k1].repeat_interleave(group, 1).transpose(0, 1)  # [H, lk, D]
        vs = v[k0:k1].repeat_interleave(group, 1).transpose(0, 1)
        mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril()
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=scale).transpose(0, 1))
    return torch.cat(outs)


def test_dropped_backends_are_logged_with_their_reason(monkeypatch, caplog):
    """An import error and a wrong mask are each logged at WARNING; the next one that passes runs."""
    def broken_import():
        raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice")

    monkeypatch.setitem(attention_select.FACTORIES, "flash-attn", broken_import)
    monkeypatch.setitem(attention_select.FACTORIES, "torch-varlen", lambda: _top_left_causal)
    monkeypatch.setattr(attention_select, "candidates", lambda device, dtype: (
        ["flash-attn", "torch-varlen", "torch-varlen-repeat-kv", "efficient-varlen", "sdpa-padded"],
        {}))
    monkeypatch.setattr(attention_select, "_varlen_lacks_gqa", lambda: False)

    def efficient():
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setitem(attention_select.FACTORIES, "efficient-varlen", efficient)
    with caplog.at_level(logging.INFO, logger="models.attention.select"):
        backend = select_backend("cpu", dtype=torch.float32, heads=4, kv_heads=2, head_dim=16)
    assert backend.name == "sdpa-padded" and backend.fn is sdpa_padded
    warned = {r.getMessage().split()[2]: r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING}
    assert set(warned) == {"flash-attn", "torch-varlen", "efficient-varlen"}
    assert "undefined symbol" in warned["flash-attn"] and "H=4, Hkv=2, D=16" in warned["flash-attn"]
    assert "probe: max abs error" in warned["torch-varlen"]
    assert "no kernel image" in warned["efficient-varlen"]
    assert backend.rejected["flash-attn"].startswith("ImportError")
    assert backend.rejected["torch-varlen-repeat-kv"].startswith("not needed")
    assert backend.rejected["sdpa"].startswith("not needed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_uses_the_model_shapes_and_passes_gqa_natively(dtype):
    seen = []

    def spy(q, k, v, meta, *, scale):
        seen.append((tuple(q.shape[1:]), tuple(k.shape[1:]), tuple(v.shape[1:]), q.dtype, scale))
        return sdpa_varlen(q, k, v, meta, scale=scale)

    assert probe(spy, torch.device("cpu"), dtype, Shape(16, 8, 128)) is None
    assert seen == [((16, 128), (8, 128), (8, 128), dtype, 128 ** -0.5)]
    assert probe(_top_left_causal, torch.device("cpu"), torch.float32, Shape(4, 1, 32)) is not None


def test_padded_plan_one_call_in_the_common_case(monkeypatch):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    gen = torch.Generator().manual_seed(3)
    # compact-style: one owner with its whole 40-token sequence, 30 owners of 1-3 new tokens.
    lens = [(40, 40)] + [(1 + s % 3, 40 + s % 3) for s in range(30)]
    cu_q, cu_k = np.cumsum([0] + [a for a, _ in lens]), np.cumsum([0] + [b for _, b in lens])
    meta = make_meta(cu_q, cu_k, "cpu")
    q, k, v = (torch.randn(int(n), 4, 8, generator=gen) for n in (cu_q[-1], cu_k[-1], cu_k[-1]))
    assert len(meta.runs) > 20  # sdpa_varlen would make one SDPA call per run
    got = sdpa_padded(q, k, v, meta, scale=0.3)
    assert len(calls) == 2 and meta.padded is meta.padded  # 2 buckets, planned once per batch
    want = naive(q, k, v, cu_q.tolist(), cu_k=cu_k.tolist(), scale=0.3)
    assert (got.double() - want).abs().max().item() < 1e-5
    calls.clear()
    uniform = make_meta([0, 30, 55, 90], [0, 40, 70, 100], "cpu")
    sdpa_padded(q[:90], k[:100], v[:100], uniform, scale=0.3)
    assert len(calls) == 1


def test_padded_plan_bounds_padding():
    """A skewed batch splits into buckets whose padded cells stay within MAX_PAD_FACTOR x (or
    2x per dimension), never one huge call."""
    lq = [2048] + [1] * 500
    lk = [2048] + [2048] * 500
    meta = make_meta(np.cumsum([0] + lq), np.cumsum([0] + lk), "cpu")
    plan = meta.padded
    cells = sum(b * q * k for b, q, k in (bk.shape for bk in plan.buckets))
    real = sum(a * b for a, b in zip(lq, lk))
    assert len(plan.buckets) == 2 and cells <= MAX_PAD_FACTOR * real
    assert sorted(int(x) for bk in plan.buckets for x in bk.q_rows) == list(range(sum(lq)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_backend_matches_portable_path(dtype):
    backend = select_backend("cuda", dtype=dtype, heads=8, kv_heads=2, head_dim=64)
    if dtype == torch.float32:  # no fused flash kernel: one call per layer, never per run
        assert backend.name in ("efficient-varlen", "sdpa-padded"), backend.rejected
    gen = torch.Generator().manual_seed(1)
    cu_q, cu_k = [0, 3, 10, 11], [0, 12, 19, 30]
    q = torch.randn(11, 8, 64, generator=gen).cuda().to(dtype)
    k = torch.randn(30, 2, 64, generator=gen).cuda().to(dtype)
    v = torch.randn(30, 2, 64, generator=gen).cuda().to(dtype)
    meta = make_meta(cu_q, cu_k, q.device)
    got = backend(q, k, v, meta, scale=0.125).float()
    want = naive(q.float(), k.float(), v.float(), cu_q, cu_k=cu_k, scale=0.125)
    assert (got.double() - want).abs().max().item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["efficient-varlen", "sdpa-padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_one_call_backends_pass_their_probe(name, dtype):
    """The one-call fallbacks work on CUDA in fp32 and bf16 (what runs without flash kernels)."""
    fn, reason = attention_select.build_backend(name, "cuda", dtype=dtype, shape=Shape(16, 8, 128))
    assert fn is not None, reason


@pytest.mark.parametrize("flavour", ["is_causal-no-scale", "window-scale-gqa"])
def test_torch_varlen_wrapper_follows_the_signature(monkeypatch, flavour):
    """The wrapper passes only the keywords this torch's varlen_attn takes (2.11 vs later)."""
    import sys
    import types

    seen = {}

    def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kw):
        seen.update(kw, kv_heads=key.shape[1])
        meta = make_meta(cu_seq_q.tolist(), cu_seq_k.tolist(), query.device)
        if key.shape[1] != query.shape[1] and "enable_gqa" in kw:
            assert kw["enable_gqa"]
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
    fn = attention_select._torch_varlen(repeat_kv=False)
    gen = torch.Generator().manual_seed(2)
    cu_q, cu_k = [0, 2, 5], [0, 4, 7]
    q = torch.randn(5, 4, 16, generator=gen)
    k, v = torch.randn(7, 2, 16, generator=gen), torch.randn(7, 2, 16, generator=gen)
    meta = make_meta(cu_q, cu_k, q.device)
    got = fn(q, k, v, meta, scale=0.25)  # the default scale for D = 16
    want = naive(q, k, v, cu_q, cu_k=cu_k, scale=0.25)
    assert (got.double() - want).abs().max().item() < 1e-5
    assert seen["kv_heads"] == 2  # GQA passed natively: K/V keep their 2 heads
    if flavour == "is_causal-no-scale":
        assert "scale" not in seen
        seen.clear()
        repeat = attention_select._torch_varlen(repeat_kv=True)
        assert (repeat(q, k, v, meta, scale=0.25).double() - want).abs().max().item() < 1e-5
        assert seen["kv_heads"] == 4  # the fallback variant repeats them
        with pytest.raises(ValueError, match="scale"):
            fn(q, k, v, meta, scale=0.1)  # a non-default scale cannot be honoured silently
    else:
        assert seen["scale"] == 0.25
