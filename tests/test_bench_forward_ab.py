"""The model-change tools behind `bench forward --ab/--count-ops/--attention-ab`, on a tiny model."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import bench_forward_ab as tools
from models.runner import load_runner

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def runner(tiny_embedding_dir):
    return load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32")


def test_ops_per_layer_counts_the_fused_layer(runner):
    counts = tools.count_ops(runner, batch=3, prefix=6, suffix=3, seed=0)
    assert set(counts) == {"off", "paper", "compact"}
    off = counts["off"]["ops"]
    # one GEMM for q/k/v, one for gate/up, then o and down; three norms; one rotary addcmul
    gemms = off.get("aten::linear", 0) + off.get("mkldnn::_linear_pointwise", 0)  # packed on the CPU
    assert gemms == 4 and off["aten::rms_norm"] == 3 and off["aten::addcmul"] == 1
    assert "aten::pow" not in off and "aten::rsqrt" not in off
    assert counts["off"]["compute"] < counts["off"]["total"]
    assert counts["paper"]["ops"]["aten::index_select"] == 4  # Q, K, V scatter + output gather


def test_ab_against_the_same_code_agrees_exactly(runner, tiny_embedding_dir):
    old = tools.old_model(runner, ROOT, str(tiny_embedding_dir))
    rows = tools.ab(runner, old, batch=3, prefixes=[5], suffix=3, warmup=0, repeats=1, seed=0)
    assert [r["mode"] for r in rows] == ["off", "paper", "compact"]
    assert all(r["max_abs_diff"] == 0.0 and r["old_ms"] > 0 and r["new_ms"] > 0 for r in rows)


def test_attention_ab_rows(runner):
    rows = tools.attention_ab(runner, batch=3, prefixes=[5], suffix=3, repeats=1, seed=0)
    compact = next(r for r in rows if r["mode"] == "compact")
    assert compact["buckets"] >= 1 and compact["sdpa_ms"] > 0 and compact["padded_ms"] > 0
