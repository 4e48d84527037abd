"""Tree attention (shared segments read once, own blocks causal, log-sum-exp merge) is exact.

Attention level: the tree path on tries hypothesis draws, against the float64 naive per-sequence
reference of test_model_attention over each owner's gathered keys. Model level: tree attention
forced on, with and without the prefix cache (hits mid-block, pool rows before new rows),
against transformers' own Qwen3 classes in fp32 (1e-4). And the CPU serving path never builds a
dense [lq, lk] mask.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import models.attention.varlen as attention
from models.attention.lse import merge_into
from models.attention.tree_select import select_tree
from models.batch import build_forward_batch
from models.trie import build_index, positions_from_cu_seqlens
from models.runner import load_runner
from models.attention.tree import plan_tree, tree_cpu
from tests.test_model_attention import naive

TOL = 1e-4
# tries over a 3-token alphabet: deep shared runs, sequences that are prefixes of others, duplicates
_tries = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), min_size=1, max_size=8)


def _pack(seqs):
    ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    cu[1:] = np.cumsum([len(s) for s in seqs])
    return ids, cu


def _compact(seqs):
    ids, cu = _pack(seqs)
    return build_forward_batch(ids, cu, build_index(ids, positions_from_cu_seqlens(cu), cu),
                               mode="compact")


@settings(max_examples=60, deadline=None)
@given(_tries, st.sampled_from([(4, 4), (4, 2), (4, 1)]), st.integers(0, 3))
def test_tree_path_matches_naive_float64(seqs, heads, pool_rows):
    """pool_rows source rows ahead of the new ones stand for prefix-cache reads: owners' keys
    index [pool | new] and the first `pool_rows` keys of every sequence come from the pool."""
    fb = _compact([[t + 10 for t in s] for s in seqs])
    h, hkv = heads
    kv = fb.kv_host.copy()
    cu_q, cu_k = fb.attn.host_cu_seqlens_q, fb.attn.host_cu_seqlens_k
    gen = torch.Generator().manual_seed(len(kv) * 7 + pool_rows)
    q = torch.randn(fb.num_rows, h, 8, generator=gen)
    k = torch.randn(pool_rows + fb.num_rows, hkv, 8, generator=gen)
    v = torch.randn(pool_rows + fb.num_rows, hkv, 8, generator=gen)
    kv = kv + pool_rows
    plan = plan_tree(cu_q, cu_k, kv, own_offset=pool_rows, heads=h, kv_heads=hkv, head_dim=8,
                     device="cpu", force=True)
    assert plan is not None
    got = tree_cpu(q, k, v, plan, scale=0.35)
    want = naive(q, k[kv], v[kv], list(cu_q), cu_k=list(cu_k), scale=0.35)
    assert (got.double() - want).abs().max().item() < 1e-5
    # every ancestor key is read by exactly one shared call per reader, never copied per owner
    shared_keys = sum(c.k1 - c.k0 for c in plan.shared)
    assert shared_keys == len(np.unique(kv[np.concatenate(
        [np.arange(cu_k[s], cu_k[s + 1] - (cu_q[s + 1] - cu_q[s])) for s in range(len(cu_q) - 1)]
        + [np.zeros(0, np.int64)]).astype(np.int64)]))


@pytest.mark.parametrize("pieces", [1, 2, 3])
def test_shared_calls_in_pieces_match_naive(monkeypatch, pieces):
    """A shared call split into pieces of a few query rows (contiguous and gathered readers)
    gives what one call gives."""
    import models.attention.tree as tree_attention

    monkeypatch.setattr(tree_attention, "SHARED_ROWS", pieces)
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9], [1, 2, 3, 4, 5, 10, 11], [1, 12]]
    fb = _compact(seqs)
    cu_q, cu_k = fb.attn.host_cu_seqlens_q, fb.attn.host_cu_seqlens_k
    plan = plan_tree(cu_q, cu_k, fb.kv_host, own_offset=0, heads=4, kv_heads=2, head_dim=8,
                     device="cpu", force=True)
    assert plan is not None and any(c.q_index is not None for c in plan.shared)
    assert any(c.q_index is None for c in plan.shared)
    gen = torch.Generator().manual_seed(pieces)
    q = torch.randn(fb.num_rows, 4, 8, generator=gen)
    k, v = torch.randn(2, fb.num_rows, 2, 8, generator=gen)
    got = tree_cpu(q, k, v, plan, scale=0.35)
    want = naive(q, k[fb.kv_host], v[fb.kv_host], list(cu_q), cu_k=list(cu_k), scale=0.35)
    assert (got.double() - want).abs().max().item() < 1e-5


def test_tree_path_in_bfloat16_merges_in_float32():
    """bf16 inputs: the own blocks and the merge accumulate in float32, the answer is bf16."""
    fb = _compact([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7], [1, 2, 3, 4, 8, 9], [5, 6]])
    cu_q, cu_k = fb.attn.host_cu_seqlens_q, fb.attn.host_cu_seqlens_k
    plan = plan_tree(cu_q, cu_k, fb.kv_host, own_offset=0, heads=4, kv_heads=2, head_dim=16,
                     device="cpu", force=True)
    assert plan is not None and plan.shared
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(fb.num_rows, 4, 16, generator=gen).bfloat16()
    k, v = (torch.randn(fb.num_rows, 2, 16, generator=gen).bfloat16() for _ in range(2))
    got = tree_cpu(q, k, v, plan, scale=0.25)
    want = naive(q, k[fb.kv_host], v[fb.kv_host], list(cu_q), cu_k=list(cu_k), scale=0.25)
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max().item() < 2e-2


def test_planner_declines_a_layout_that_is_not_compact():
    # owner 1's last key is not its own first row: not the compact layout
    assert plan_tree([0, 2, 3], [0, 2, 4], np.array([0, 1, 0, 1]), own_offset=0, heads=2,
                     kv_heads=1, head_dim=4, device="cpu", force=True) is None


def test_merge_handles_rows_with_several_partials():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(9, 2, 4, generator=gen)
    vals = torch.randn(9, 2, 4, generator=gen)
    q = torch.randn(3, 2, 4, generator=gen)

    def part(qi, ks):
        s = torch.einsum("hd,khd->hk", q[qi], keys[ks])
        return torch.einsum("hk,khd->hd", s.softmax(-1), vals[ks]), s.logsumexp(-1)

    blocks = {0: [[0, 1], [2, 3, 4], [5]], 1: [[6, 7]], 2: [[8], [0, 1, 2, 3]]}
    own = [part(r, b[0]) for r, b in blocks.items()]
    extra = [(r, *part(r, ks)) for r, b in blocks.items() for ks in b[1:]]
    got = merge_into(torch.stack([o for o, _ in own]), torch.stack([l_ for _, l_ in own]),
                     torch.stack([o for _, o, _ in extra]), torch.stack([l_ for _, _, l_ in extra]),
                     torch.tensor([r for r, _, _ in extra]))
    for r, b in blocks.items():
        want, _ = part(r, sum(b, []))
        assert (got[r] - want).abs().max().item() < 1e-5


def test_auto_choice():
    """A long shared prefix: the tree (read once instead of once per reader). Nothing shared:
    flat (the same causal calls either way). Many one-row segments: flat (a call per segment)."""
    rng = np.random.default_rng(0)
    shape = dict(heads=16, kv_heads=8, head_dim=128, device="cpu")
    prefix = rng.integers(100, 5000, 512).tolist()
    fb = _compact([prefix + rng.integers(100, 5000, 32).tolist() for _ in range(8)])
    plan = plan_tree(fb.attn.host_cu_seqlens_q, fb.attn.host_cu_seqlens_k, fb.kv_host,
                     own_offset=0, **shape)
    assert plan is not None and plan.estimate[0] <= plan.estimate[1] and len(plan.shared) == 1
    # the same batch on CUDA: flat unless forced (the tree measured slower there); decided before
    # any tensor is made, so it runs without a GPU
    cuda = dict(shape, device="cuda")
    assert plan_tree(fb.attn.host_cu_seqlens_q, fb.attn.host_cu_seqlens_k, fb.kv_host,
                     own_offset=0, **cuda) is None
    fb = _compact([rng.integers(100, 5000, 64).tolist() for _ in range(8)])
    assert plan_tree(fb.attn.host_cu_seqlens_q, fb.attn.host_cu_seqlens_k, fb.kv_host,
                     own_offset=0, **shape) is None
    # a binary trie of depth 7: each of 128 owners reads 7 segments of one row
    deep = [[int(c) for c in np.binary_repr(i, 7)] + [2] for i in range(128)]
    fb = _compact(deep)
    forced = plan_tree(fb.attn.host_cu_seqlens_q, fb.attn.host_cu_seqlens_k, fb.kv_host,
                       own_offset=0, force=True, **shape)
    assert len(forced.shared) > 100 and forced.estimate[0] > forced.estimate[1]
    assert plan_tree(fb.attn.host_cu_seqlens_q, fb.attn.host_cu_seqlens_k, fb.kv_host,
                     own_offset=0, **shape) is None


_RUNNERS: dict[str, object] = {}


def _runner(directory, size):
    if size not in _RUNNERS:
        _RUNNERS[size] = load_runner(str(directory), device="cpu", dtype="float32",
                                     prefix_cache_size=size, tree_attention="on",
                                     radix_mlp_threshold=1.0)
    return _RUNNERS[size]


def _check_batches(runner, oracle, batches, *, ahead=True):
    """Each batch against the oracle; with `ahead`, batch k+1 is prepared before batch k runs
    (as the scheduler does), else each runs (and commits to the cache) before the next."""
    pending, tree_runs = None, 0
    for seqs in batches + [None]:
        if not ahead and pending is not None:
            prepared, done = pending
            tree_runs += prepared.forward.tree is not None
            assert (runner.run(prepared) - oracle.scores(done)).abs().max().item() < TOL, done
            pending = None
        nxt = (runner.prepare(*_pack(seqs)), seqs) if seqs is not None else None
        if pending is not None:
            prepared, done = pending
            tree_runs += prepared.forward.tree is not None
            got = runner.run(prepared)
            assert (got - oracle.scores(done)).abs().max().item() < TOL, done
        pending = nxt
    return tree_runs


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_tries, min_size=1, max_size=3), st.sampled_from(["0", "48tokens", "160tokens"]))
def test_tree_forward_matches_transformers(reranker_oracle, tiny_reranker_dir, batches, size):
    runner = _runner(tiny_reranker_dir, size)
    seqs = [[[t + 200 for t in s] for s in b] for b in batches]
    assert _check_batches(runner, reranker_oracle, seqs) == len(seqs)  # the tree path ran


def test_tree_forward_structured_tries(reranker_oracle, tiny_reranker_dir):
    """Deep (a chain of prefixes), wide (64 readers of a 200-token prefix), a single sequence,
    and prefix-cache hits ending mid-block, before and after new rows in the same batch."""
    rng = np.random.default_rng(1)
    chain = rng.integers(100, 3000, 90).tolist()
    prefix = rng.integers(100, 3000, 200).tolist()
    deep = [chain[:n] for n in (5, 17, 33, 34, 60, 90)] + [chain[:40] + [7, 8], chain[:17] + [9]]
    wide = [prefix + rng.integers(100, 3000, int(rng.integers(1, 9))).tolist() for _ in range(64)]
    single = [rng.integers(100, 3000, 70).tolist()]
    mid = [single[0][:21] + rng.integers(100, 3000, 5).tolist(), single[0][:37] + [11, 12],
           chain[:23] + [13]]
    for size in ("0", "160tokens"):
        runner = _runner(tiny_reranker_dir, size)
        assert _check_batches(runner, reranker_oracle, [deep, wide, single, mid]) == 4
    cache = _runner(tiny_reranker_dir, "160tokens").prefix_cache
    assert cache.stats()["hit_tokens"] > 0


def test_cpu_serving_path_builds_no_dense_mask(tiny_reranker_dir, reranker_oracle, monkeypatch):
    """A cached long prefix and new rows after it: neither the flat nor the tree path asks for
    a bottom-right [lq, lk] mask under inference (autograd still may: it needs the masked call)."""
    def refuse(*args, **kwargs):
        raise AssertionError("dense mask on the serving path")

    monkeypatch.setattr(attention, "bottom_right_mask", refuse)
    rng = np.random.default_rng(2)
    base = rng.integers(100, 3000, 60).tolist()
    for policy in ("off", "on"):
        runner = load_runner(str(tiny_reranker_dir), device="cpu", dtype="float32",
                             prefix_cache_size="256tokens", tree_attention=policy)
        batches = [[base], [base[:45] + [5, 6, 7], base + [9] * 30], [base[:20] + [4] * 40]]
        _check_batches(runner, reranker_oracle, batches, ahead=False)
        assert runner.prefix_cache.stats()["hit_tokens"] > 100


def test_report_names_the_tree_path(tiny_reranker_dir):
    runner = load_runner(str(tiny_reranker_dir), device="cpu", dtype="float32")
    assert runner.attention_report["tree_attention"] == "auto (cpu-flash)"
    on_cuda = dataclasses.replace(runner, device=torch.device("cuda"))  # the report reads only .device
    assert on_cuda.tree_report.startswith("auto (cpu-flash; flat on cuda, where the tree measured slower")
    assert dataclasses.replace(on_cuda, tree_attention="on").tree_report == "on (cpu-flash)"
    off = dataclasses.replace(runner, tree_attention="off")
    assert off.attention_report["tree_attention"] == "off"
    seqs = [[300 + i for i in range(40)] + [7, s] for s in range(6)]
    assert off.prepare(*_pack(seqs)).forward.tree is None
    with pytest.raises(ValueError, match="tree_attention"):
        load_runner(str(tiny_reranker_dir), device="cpu", tree_attention="sometimes")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_tree_path_passes_its_probe_and_matches(dtype):
    path, rejected = select_tree("cuda", dtype=dtype, heads=16, kv_heads=8, head_dim=128)
    assert path is not None, rejected
    fb = _compact([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7], [1, 2, 3, 4, 8, 9], [5, 6]])
    cu_q, cu_k = fb.attn.host_cu_seqlens_q, fb.attn.host_cu_seqlens_k
    plan = plan_tree(cu_q, cu_k, fb.kv_host, own_offset=0, heads=16, kv_heads=8, head_dim=128,
                     device="cuda", force=True)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(fb.num_rows, 16, 128, generator=gen)
    k, v = (torch.randn(fb.num_rows, 8, 128, generator=gen) for _ in range(2))
    got = path.fn(q.cuda().to(dtype), k.cuda().to(dtype), v.cuda().to(dtype), plan,
                  scale=1 / math.sqrt(128))
    want = naive(q, k[fb.kv_host], v[fb.kv_host], list(cu_q), cu_k=list(cu_k), scale=1 / math.sqrt(128))
    assert (got.double().cpu() - want).abs().max().item() < 2e-2


def test_pair_budget_counts_what_the_encoder_builds(tiny_reranker_dir):
    """pair_tokens equals the encoder's own pair lengths (capped at max_length); over the limit,
    a 422-ready ValueError names the limit and the flag that raises it."""
    from models.text.pair_budget import PairBudgetExceeded, check_pair_budget, pair_tokens
    from models.text.prompts import DEFAULT_INSTRUCTION, RerankTemplate, format_rerank_body

    runner = load_runner(str(tiny_reranker_dir), device="cpu", dtype="float32", prefix_cache_size=0)
    enc = RerankTemplate(runner.tokenizer)
    query, docs = "capital of france " * 20, ["Paris is the capital.", "Berlin " * 200, "x"]
    pairs = enc.encode(query, docs, max_length=300, truncate=True)
    body = format_rerank_body(DEFAULT_INSTRUCTION, query, "")[:-1]  # the shared part of every body
    shared = len(runner.tokenizer.encode(body, add_special_tokens=False).ids)
    own = [len(runner.tokenizer.encode(" " + d, add_special_tokens=False).ids) for d in docs]
    total = pair_tokens(overhead=enc.overhead, bodies=[shared + n for n in own], max_length=300)
    assert total == sum(len(p) for p in pairs)
    check_pair_budget(total, documents=3, limit=total)
    check_pair_budget(total, documents=3, limit=0)  # 0: no limit
    with pytest.raises(PairBudgetExceeded, match=r"limit of %d \(--max-rerank-pair-tokens\)" % (total - 1)):
        check_pair_budget(total, documents=3, limit=total - 1)
