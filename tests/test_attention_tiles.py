"""The CPU's oneDNN attention tiles are exact, serve only where they should, and are chosen at
load only when they passed a float64 check and measured faster than the flash kernel.

Tile level: ``tiled_lse`` against a float64 dense-softmax reference on shapes hypothesis draws
(with small tiles, so every kind of tile appears: full, causal diagonal, tail, padded rows), on
one thread and on the worker pool. Model level: tiles forced on for every block, tree attention
on and off, with and without the prefix cache, against transformers' own Qwen3 classes in fp32.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.attention import lse as attention_lse
from models.attention import tiles as attention_tiles
from models.attention.tiles import key_tiles, tiled_lse, use_tiles
from models.runner import load_runner
from tests.test_tree_attention import _check_batches

TOL = 1e-4


def reference(q, k, v, *, causal, scale):
    """float64, dense scores and mask, K/V repeated per query head: nothing shared with tiles."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("ghqd,ghkd->ghqk", q, k) * scale
    if causal:
        lq = q.shape[2]
        scores = scores.masked_fill(torch.ones(lq, lq, dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 4 query rows and 8 keys serving every block (as on a model, blocks of any size)."""
    monkeypatch.setattr(attention_tiles, "TILE_Q", 4)
    monkeypatch.setattr(attention_tiles, "TILE_K", 8)
    monkeypatch.setattr(attention_tiles, "MIN_PAIRS", 1)
    monkeypatch.setitem(attention_tiles._state, "on", True)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 3), st.sampled_from([(4, 4), (4, 2), (4, 1), (6, 2)]), st.integers(1, 40),
       st.integers(1, 40), st.booleans())
def test_tiles_match_float64(small_tiles, threads, g, heads, lq, lk, causal):
    h, hkv = heads
    lk = lq if causal else lk
    gen = torch.Generator().manual_seed(g * 1000 + lq * 41 + lk)
    # q as the model hands it: a transposed view of [g, L, H, D], not contiguous
    q = torch.randn(g, lq, h, 8, generator=gen).transpose(1, 2)
    k = torch.randn(g, lk, hkv, 8, generator=gen).transpose(1, 2)
    v = torch.randn(g, lk, hkv, 8, generator=gen).transpose(1, 2)
    with torch.no_grad():
        out, lse = tiled_lse(q, k, v, causal=causal, scale=0.4)
    want, want_lse = reference(q, k, v, causal=causal, scale=0.4)
    assert out.shape == (g, h, lq, 8) and lse.shape == (g, h, lq)
    assert (out.double() - want).abs().max().item() < 1e-5
    assert (lse.double() - want_lse).abs().max().item() < 1e-5


@pytest.mark.parametrize("lq, lk, causal", [(600, 600, True), (130, 700, False), (1029, 1029, True)])
def test_tiles_at_their_real_size_match_float64(threads, lq, lk, causal):
    gen = torch.Generator().manual_seed(lq)
    q = torch.randn(1, 4, lq, 32, generator=gen)
    k, v = torch.randn(2, 1, 2, lk, 32, generator=gen)
    with torch.inference_mode():
        out, lse = tiled_lse(q, k, v, causal=causal, scale=0.2)
    want, want_lse = reference(q, k, v, causal=causal, scale=0.2)
    assert (out.double() - want).abs().max().item() < 1e-5
    assert (lse.double() - want_lse).abs().max().item() < 1e-5


@pytest.mark.parametrize("lq, lk, causal", [(1, 9, False), (13, 40, False), (37, 37, True), (8, 8, True)])
def test_key_tiles_cover_each_key_once_and_mask_only_where_needed(small_tiles, lq, lk, causal):
    tq, tk = attention_tiles.TILE_Q, attention_tiles.TILE_K
    for q0 in range(0, lq, tq):
        q1 = min(lq, q0 + tq)
        tiles = key_tiles(q0, q1, lk, causal)
        keys = [c for c0, n in tiles for c in range(c0, c0 + n)]
        end = q1 if causal else lk
        assert keys[:end] == list(range(end)) and len(keys) - end < tq  # each once; padding < a tile
        for c0, n in tiles:
            if n == tk:  # a full tile: every query of [q0, q1) sees all its keys
                assert c0 + n <= (q0 if causal else lk)
        if causal:
            assert tiles[-1] == (q0, tq)  # the diagonal tile is last and starts at the tile's row


def test_use_tiles_only_where_tiles_pay(monkeypatch):
    monkeypatch.setitem(attention_tiles._state, "on", True)
    big_q, big_k = torch.empty(1, 16, 2048, 8), torch.empty(1, 8, 2048, 8)
    assert use_tiles(big_q, big_k, causal=True) and use_tiles(big_q, big_k, causal=False)
    assert not use_tiles(big_q[:, :, :128], big_k, causal=False)  # 128 x 2048 x 2: below MIN_PAIRS
    assert not use_tiles(big_q[:, :, :511], big_k[:, :, :511], causal=True)
    assert not use_tiles(big_q.double(), big_k.double(), causal=True)
    assert not use_tiles(big_q.requires_grad_(), big_k, causal=True)  # autograd: the flash kernel
    monkeypatch.setitem(attention_tiles._state, "on", False)
    assert not use_tiles(torch.empty(1, 16, 2048, 8), big_k, causal=True)


def test_selection_needs_a_match_and_a_measured_gain(monkeypatch):
    """The decision follows the self-test and the measured ratio (stand-ins for both)."""
    shape = {"heads": 4, "kv_heads": 2, "head_dim": 16}
    monkeypatch.setattr(attention_lse, "_measure", lambda *a: 1.5)
    assert attention_lse.select_cpu_kernel(True, **shape).startswith("onednn-tiles")
    assert attention_tiles._state["on"]
    assert attention_lse.select_cpu_kernel(False, **shape) == "flash (cpu_packed_weights off)"
    assert not attention_tiles._state["on"]
    monkeypatch.setattr(attention_lse, "_measure", lambda *a: 1.05)
    report = attention_lse.select_cpu_kernel(True, **shape)
    assert report.startswith("flash (oneDNN tiles ran 1.05x") and not attention_tiles._state["on"]


def test_a_wrong_tile_kernel_fails_its_self_test(monkeypatch):
    def off_by_a_bit(q, k, v, *, causal, scale):
        out, lse = attention_lse.flash_lse(q, k, v, causal=causal, scale=scale)
        return out + 1e-3, lse

    monkeypatch.setattr(attention_tiles, "tiled_lse", off_by_a_bit)
    attention_lse._measure.cache_clear()  # a real, cached measurement would not run the check
    report = attention_lse.select_cpu_kernel(True, heads=4, kv_heads=2, head_dim=8)
    assert report.startswith("flash (oneDNN tiles failed their self-test: max error")
    assert not attention_tiles._state["on"]


def test_the_real_measurement_decides_and_is_reported(tiny_reranker_dir):
    """On this machine, whichever way it goes: the runner reports it, /info-ready."""
    runner = load_runner(str(tiny_reranker_dir), device="cpu", dtype="float32")
    assert runner.report.cpu_attention.startswith(("onednn-tiles for large blocks (", "flash (oneDNN tiles ran"))
    assert attention_tiles._state["on"] == runner.report.cpu_attention.startswith("onednn-tiles")
    off = load_runner(str(tiny_reranker_dir), device="cpu", dtype="float32", cpu_packed_weights=False)
    assert off.report.cpu_attention == "flash (cpu_packed_weights off)" and not attention_tiles._state["on"]


@contextlib.contextmanager
def tile_calls():
    """The `causal` flag of every ``tiled_lse`` call made inside the block, in order."""
    calls: list[bool] = []
    real = attention_tiles.tiled_lse

    def counting(*args, **kwargs):
        calls.append(kwargs["causal"])
        return real(*args, **kwargs)

    attention_tiles.tiled_lse = counting
    try:
        yield calls
    finally:
        attention_tiles.tiled_lse = real


@pytest.fixture(scope="module")
def tiled_runners(tiny_reranker_dir):
    """{(tree policy, cache size): runner}, loaded before any test shrinks the tiles (the load
    measures the real ones)."""
    return {(policy, size): load_runner(str(tiny_reranker_dir), device="cpu", dtype="float32",
                                        prefix_cache_size=size, tree_attention=policy,
                                        radix_mlp_threshold=1.0)
            for policy in ("on", "off") for size in ("0", "160tokens")}


@pytest.mark.parametrize("policy", ["on", "off"])
def test_forward_with_tiles_matches_transformers(reranker_oracle, tiled_runners, small_tiles,
                                                 threads, policy):
    """Every attention block of the forward through (small) tiles: deep and wide tries, a single
    long sequence, prefix-cache hits mid-block; tree attention on and off."""
    rng = np.random.default_rng(3)
    chain = rng.integers(100, 3000, 70).tolist()
    prefix = rng.integers(100, 3000, 50).tolist()
    deep = [chain[:n] for n in (5, 17, 33, 60, 70)] + [chain[:40] + [7, 8]]
    wide = [prefix + rng.integers(100, 3000, int(rng.integers(1, 9))).tolist() for _ in range(12)]
    single = [rng.integers(100, 3000, 45).tolist()]
    mid = [single[0][:21] + [5, 6, 7], chain[:23] + [13]]
    for size in ("0", "160tokens"):
        with tile_calls() as calls:
            _check_batches(tiled_runners[(policy, size)], reranker_oracle, [deep, wide, single, mid],
                           ahead=False)
        assert calls  # the tiles served


@pytest.fixture(scope="module")
def embedding_pair(tiny_embedding_dir):
    """(runner, transformers' oracle) for the tiny embedding model, loaded at real tile sizes."""
    from transformers import AutoModel

    from tests.test_model_forward import Oracle

    runner = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32")
    hf = AutoModel.from_pretrained(str(tiny_embedding_dir), dtype=torch.float32).eval()
    return runner, Oracle(hf, causal_lm=False)


@pytest.mark.parametrize("mode", ["off", "compact"])
def test_mean_pooled_forward_with_tiles_matches_transformers(embedding_pair, small_tiles, threads, mode):
    """Mean pooling reads every position's last hidden state, so a block whose tiles let a query
    see a later key (or miss one) shows here even where a last-token score would hardly move."""
    from tests.test_model_forward import _ours

    runner, oracle = embedding_pair
    rng = np.random.default_rng(4)
    prefix = rng.integers(100, 3000, 37).tolist()
    seqs = [prefix + rng.integers(100, 3000, n).tolist() for n in (3, 11, 29)] + [prefix[:9]]
    with tile_calls() as calls:
        got = _ours(runner, seqs, mode, pooling="mean")
    assert True in calls  # causal blocks went through the tiles
    assert (got - oracle.embed(seqs, "mean")).abs().max().item() < TOL
