"""The log-sum-exp attention blocks (models/attention/lse.py) against a plain float64 softmax.

The reference here is softmax(q k^T * scale) v and logsumexp(q k^T * scale), one query head at
a time with its K/V head h // group, written out with matmuls: no kernel of the code under test.
Both ways the causal block meets GQA are checked: K/V heads handed to the kernel as they are
(where it broadcasts them) and repeated per query head (the fallback).
"""
from __future__ import annotations

import pytest
import torch

import models.attention.lse as attention_lse
from models.attention.lse import block_lse, merge_two, merge_two_


def reference(q, k, v, *, causal, scale):
    """q [g, H, Lq, D], k/v [g, Hkv, Lk, D] -> (out [g, H, Lq, D], lse [g, H, Lq]) in float64."""
    q, k, v = q.double(), k.double(), v.double()
    g, heads, lq, _ = q.shape
    group = heads // k.shape[1]
    out = torch.empty(g, heads, lq, v.shape[-1], dtype=torch.float64)
    lse = torch.empty(g, heads, lq, dtype=torch.float64)
    for b in range(g):
        for h in range(heads):
            s = q[b, h] @ k[b, h // group].T * scale  # [Lq, Lk]
            if causal:  # query i sees keys j <= i
                s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
            m = s.max(dim=1, keepdim=True).values
            w = (s - m).exp()
            out[b, h] = (w / w.sum(1, keepdim=True)) @ v[b, h // group]
            lse[b, h] = m[:, 0] + w.sum(1).log()
    return out, lse


def _qkv(g, heads, kv_heads, lq, lk, dim=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(g, heads, lq, dim, generator=gen)
    k = torch.randn(g, kv_heads, lk, dim, generator=gen)
    v = torch.randn(g, kv_heads, lk, dim, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("native", [True, False], ids=["kv-heads-as-they-are", "repeated"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("g,n", [(1, 1), (1, 37), (3, 5), (2, 300)])
def test_causal_block_matches_plain_softmax(monkeypatch, native, heads, kv_heads, g, n):
    if not native:
        monkeypatch.setattr(attention_lse, "flash_takes_gqa", lambda: False)
    elif not attention_lse.flash_takes_gqa():
        pytest.skip("this torch's CPU flash kernel does not broadcast K/V heads")
    q, k, v = _qkv(g, heads, kv_heads, n, n, seed=n)
    out, lse = block_lse(q, k, v, causal=True, scale=0.3)
    want, want_lse = reference(q, k, v, causal=True, scale=0.3)
    assert out.shape == (g, heads, n, 8) and lse.shape == (g, heads, n)
    assert (out.double() - want).abs().max().item() < 1e-5
    assert (lse.double() - want_lse).abs().max().item() < 1e-5


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("g,lq,lk", [(1, 1, 9), (1, 130, 7), (2, 3, 513), (1, 257, 1031)])
def test_unmasked_block_folds_query_heads_exactly(heads, kv_heads, g, lq, lk):
    """Every query sees every key; GQA folds a group's query heads into the query axis."""
    q, k, v = _qkv(g, heads, kv_heads, lq, lk, seed=lq + lk)
    out, lse = block_lse(q, k, v, causal=False, scale=0.3)
    want, want_lse = reference(q, k, v, causal=False, scale=0.3)
    assert (out.double() - want).abs().max().item() < 1e-5
    assert (lse.double() - want_lse).abs().max().item() < 1e-5


def test_flash_gqa_check_agrees_with_the_kernel():
    """The check's answer is what the kernel does: given fewer K/V heads it either raises or
    computes what the repeated K/V give."""
    q, k, v = _qkv(1, 4, 2, 6, 6, seed=3)
    want = attention_lse._CPU_FLASH(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), 0.0,
                                    True, scale=0.3)[0]
    try:
        got = attention_lse._CPU_FLASH(q, k, v, 0.0, True, scale=0.3)[0]
        same = got.shape == want.shape and bool(torch.allclose(got, want, atol=1e-6))
    except RuntimeError:
        same = False
    assert attention_lse.flash_takes_gqa() is same


@pytest.mark.parametrize("in_place", [False, True])
def test_merging_two_key_blocks_is_attention_over_both(in_place):
    """A prefix block without a mask and the queries' own block causally, merged, equal the
    bottom-right causal attention over all keys (the split the flat and tree paths make)."""
    q, k, v = _qkv(2, 4, 2, 6, 19, seed=5)
    pre = 13
    o1, l1 = block_lse(q, k[:, :, :pre], v[:, :, :pre], causal=False, scale=0.3)
    o2, l2 = block_lse(q, k[:, :, pre:], v[:, :, pre:], causal=True, scale=0.3)
    if in_place:
        merge_two_(o1, l1, o2, l2)
        out, lse = o1, l1
    else:
        out, lse = merge_two(o1, l1, o2, l2)
    # bottom-right over all 19 keys: query i sees keys j <= i + pre
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double().repeat_interleave(2, 1)) * 0.3
    allowed = torch.arange(19)[None, :] <= torch.arange(6)[:, None] + pre  # [6, 19]
    s = s.masked_fill(~allowed, float("-inf"))
    want = torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v.double().repeat_interleave(2, 1))
    assert (out.double() - want).abs().max().item() < 1e-5
    assert (lse.double() - s.logsumexp(-1)).abs().max().item() < 1e-5
