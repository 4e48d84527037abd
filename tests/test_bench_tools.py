"""The forward and index benchmarks run, and the figures they derive (not the times) are right.

Times are never asserted. What is checked against an independent computation: N' (a Python set of
distinct prefixes, i.e. the trie's nodes) and the position-wise FLOPs behind the Amdahl
prediction (torch's FlopCounterMode on the `off` forward).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import bench_forward, bench_index
from models.linear.packed import pack_linears, unpack_linears
from models.batch import build_forward_batch
from models.runner import load_runner


def _distinct_prefixes(ids: np.ndarray, cu: np.ndarray) -> int:
    seqs = [tuple(ids[a:b].tolist()) for a, b in zip(cu[:-1], cu[1:])]
    return len({s[:i + 1] for s in seqs for i in range(len(s))})


@pytest.fixture(scope="module")
def runner(tiny_embedding_dir):
    return load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32")


def test_forward_bench_rows(runner):
    rows = bench_forward.bench(runner, batch=3, prefixes=[0, 12], suffix=5, warmup=0, repeats=1,
                               seed=1)
    assert [(r.prefix, r.mode) for r in rows] == [(p, m) for p in (0, 12)
                                                  for m in ("off", "paper", "compact")]
    for prefix in (0, 12):
        ids, cu = bench_forward.synthetic_batch(3, prefix, 5, vocab=runner.config.vocab_size,
                                                seed=1)
        want = _distinct_prefixes(ids, cu)
        by_mode = {r.mode: r for r in rows if r.prefix == prefix}
        assert by_mode["off"].compact_tokens == by_mode["off"].tokens == len(ids)
        assert by_mode["off"].speedup == 1.0 and by_mode["off"].amdahl == 1.0
        for mode in ("paper", "compact"):
            assert by_mode[mode].compact_tokens == want
            assert by_mode[mode].ratio == pytest.approx(want / len(ids))
            assert by_mode[mode].index_ms >= 0.0
    assert rows[-1].compact_tokens == 12 + 3 * 5  # one shared prefix, three own suffixes


def test_position_wise_share_counts_the_linear_flops(runner):
    """f's numerator equals the matmul FLOPs torch counts in the `off` forward."""
    cfg = runner.config
    lens = [7, 3, 11]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, int(cu[-1])).astype(np.int32)
    fb = build_forward_batch(ids, cu, None, mode="off")
    counter = FlopCounterMode(display=False)
    unpack_linears(runner.model)  # the FLOP counter knows aten's matmuls, not oneDNN's packed op
    try:
        with torch.inference_mode(), counter:
            runner.forward(fb)
    finally:
        pack_linears(runner.model, device=runner.device, dtype=runner.dtype)
    counts = counter.get_flop_counts()["Global"]
    linear = sum(v for op, v in counts.items() if "mm" in str(op) and "bmm" not in str(op))
    attn_useful = cfg.num_hidden_layers * sum(
        2 * 2 * cfg.num_attention_heads * cfg.head_dim * n * (n + 1) / 2 for n in lens)
    f = bench_forward.position_wise_share(cfg, lens)
    assert f == pytest.approx(linear / (linear + attn_useful), rel=1e-9)


def test_forward_bench_cli_json(tiny_embedding_dir, capsys):
    rc = bench_forward.main(["--model-dir", str(tiny_embedding_dir), "--batch", "2", "--prefix",
                             "0", "4", "--suffix", "3", "--repeats", "1", "--warmup", "0",
                             "--modes", "off", "compact", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["device"] == "cpu" and out["attention_backend"] == "sdpa"
    assert [(r["prefix"], r["mode"]) for r in out["rows"]] == [(0, "off"), (0, "compact"),
                                                               (4, "off"), (4, "compact")]


@pytest.mark.parametrize("share", [0.0, 0.25, 1.0])
def test_index_bench_counts_trie_nodes(share):
    ids, pos, cu = bench_index.shared_prefix_batch(6, 20, share, seed=3)
    result = bench_index.measure("case", (ids, pos, cu), repeats=1)
    assert result.tokens == 120 and result.compact_tokens == _distinct_prefixes(ids, cu)
    assert result.median_ms > 0 and result.tokens_per_s > 0


def test_index_bench_branch_case():
    ids, pos, cu = bench_index.branch_batch(64)
    result = bench_index.measure("branches", (ids, pos, cu), repeats=1)
    assert result.compact_tokens == 1 + 64 == _distinct_prefixes(ids, cu)


def test_linear_bench_compares_both_paths(tiny_embedding_dir, capsys):
    from benchmarks import bench_linear

    assert bench_linear.main(["--model-dir", str(tiny_embedding_dir), "--rows", "1", "9", "--repeats", "1"]) == 0
    machine_line, *lines = capsys.readouterr().out.strip().splitlines()
    assert machine_line.startswith("# machine: ")
    assert lines[0].startswith("# packed (oneDNN) vs plain")
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["1", "9"]
    assert all(float(r[-1]) < 1e-4 for r in rows)  # both paths compute the same embeddings
