"""The host-ceiling benchmark runs in its smallest form and its figures are consistent.

Times are never asserted: the checks are that every field is there, that the per-thread CPU
figures add up to the process's, that tokens/s and items/s agree with the counts and the wall
time, and that the zero forward answers each request (no errors) without running the model.
"""
from __future__ import annotations

import math

import pytest

from benchmarks import host_ceiling
from benchmarks.host_ceiling import GROUPS, figures, group_of
from benchmarks.paired_rounds import paired, paired_table


def test_group_of_names_the_server_threads():
    assert group_of("MainThread") == "loop"
    assert group_of("radixserve-tok_3") == "tokenizer"
    assert [group_of(n) for n in ("rs-prep", "rs-worker", "rs-settle")] == ["prep", "worker", "settle"]
    assert group_of("native") == "native"
    assert group_of("asyncio_0") == "other"


def test_figures_split_the_process_cpu_by_thread():
    before = {"process_cpu_s": 10.0, "forwards": 3, "worker_forwards": 2, "worker_forward_cpu_s": 0.01,
              "threads": {"MainThread:1": 1.0, "rs-worker:2": 2.0, "native:7": 0.5, "gone:9": 0.2}}
    after = {"process_cpu_s": 14.0, "forwards": 7, "worker_forwards": 5, "worker_forward_cpu_s": 0.04,
             "threads": {"MainThread:1": 2.5, "rs-worker:2": 2.6, "native:7": 1.0, "rs-prep:3": 0.9,
                         "radixserve-tok_0:4": 0.3}}
    f = figures(before, after, tokens=2e6, items=40, wall_s=2.0)
    by = {g: v * 2 for g, v in f["cpu_s_per_1m_tokens_by_thread"].items()}  # back to seconds
    assert by["loop"] == pytest.approx(1.5) and by["worker"] == pytest.approx(0.6)
    assert by["prep"] == pytest.approx(0.9) and by["tokenizer"] == pytest.approx(0.3)
    assert by["native"] == pytest.approx(0.5)
    assert sum(by.values()) == pytest.approx(4.0)  # "other" takes the rest (threads that ended)
    assert f["cpu_s_per_1m_tokens"] == pytest.approx(2.0)
    assert f["batches"] == 4 and f["worker_batches"] == 3
    assert f["worker_non_forward_ms_per_batch"] == pytest.approx((0.6 - 0.03) / 3 * 1e3, abs=1e-3)
    assert f["tokens_per_s"] == 1_000_000 and f["items_per_s"] == 20.0


def test_smallest_run_has_every_field():
    rows = host_ceiling.host_ceiling(["embed-template", "one-input"], ["0"], rounds=1, duration=None,
                                     requests=3, queries=40)
    assert [(r["load"], r["prefix_cache_size"]) for r in rows] == [("embed-template", "0"), ("one-input", "0")]
    for r in rows:
        assert r["errors"] == {} and not r["repeated"]
        assert r["tokens"] > 0 and r["batches"] >= 1
        assert r["items"] == (3 if r["load"] == "one-input" else 3 * 64)
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["wall_s"], rel=0.05)
        assert r["items_per_s"] == pytest.approx(r["items"] / r["wall_s"], rel=0.05)
        by = r["cpu_s_per_1m_tokens_by_thread"]
        assert set(by) == set(GROUPS)
        assert sum(by.values()) == pytest.approx(r["cpu_s_per_1m_tokens"], abs=0.01 * len(GROUPS))
        assert by["loop"] > 0 and r["cpu_s_per_1m_tokens"] > 0
        w = r["worker_non_forward_ms_per_batch"]
        assert (w is None) == (r["worker_batches"] == 0) and (w is None or math.isfinite(w))


def test_paired_ratios_are_taken_round_by_round():
    def row(cache, cpu, tps):
        return {"load": "embed-template", "prefix_cache_size": cache, "api_server_count": 1,
                "all_cpu_s_per_1m_tokens": sum(cpu) / len(cpu),
                "per_round": [{"all_cpu_s_per_1m_tokens": c, "tokens_per_s": t} for c, t in zip(cpu, tps)]}

    on, off = row("auto", [1.2, 2.4, 1.5], [900, 400, 800]), row("0", [1.0, 2.0, 1.5], [1000, 500, 800])
    [p] = paired([on, off])
    assert p["cpu_ratios"] == [1.2, 1.2, 1.0] and p["cpu_ratio_median"] == 1.2
    assert p["cpu_ratio_summed"] == pytest.approx((1.2 + 2.4 + 1.5) / (1.0 + 2.0 + 1.5), abs=1e-3)
    assert p["wall_ratios"] == [pytest.approx(1000 / 900, abs=1e-3), 1.25, 1.0]
    assert p["paired"] and "--prefix-cache-size auto" in p["arm"] and "--prefix-cache-size 0" in p["against"]
    assert paired([on]) == []  # one arm: nothing to pair
    assert "median 1.2" in paired_table([p])


def test_checkouts_run_their_own_code(tmp_path):
    """Each ``--checkout`` arm's server runs from its directory: this repository twice gives one row
    per checkout and their paired ratio; a directory without the code gives a server that never
    answers (the benchmark stops with the reason, not a figure of the wrong code)."""
    import pathlib

    root = str(pathlib.Path(host_ceiling.__file__).resolve().parents[1])
    rows = host_ceiling.host_ceiling(["one-input"], ["0"], rounds=1, duration=None, requests=2, queries=20,
                                     checkouts={"a": root, "b": root})
    assert [r["checkout"] for r in rows] == ["a", "b"] and all(r["errors"] == {} for r in rows)
    [p] = paired(rows)
    assert p["arm"].startswith("a: ") and p["against"].startswith("b: ")
    with pytest.raises(Exception):
        host_ceiling.host_ceiling(["one-input"], ["0"], rounds=1, duration=None, requests=2, queries=20,
                                  checkouts={"empty": str(tmp_path)})
