"""CUDA graphs for a lone short input (models/graphs.py), checked on a CPU.

What a graph computes is the padded forward: one sequence padded at the end to its bucket's
length, the first n rows kept. On a CPU the capture is replaced by a stand-in that records the
same step and reruns it into a static output (what a replay does), so these tests check the
product's padding, routing and head on the real model, and the choice logic with an injected
timer. The one test that captures for real needs CUDA and skips without it.
"""
from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

from models.graphs import BUCKETS, GraphSet, check_mode, choose
from models.runner import load_runner
from models import streams


class Recorder:
    """The CPU stand-in for torch.cuda.graph: the step's output becomes the static output, and each
    replay reruns the step into it. `bad`: the replay's output is off by that much (a wrong graph)."""

    def __init__(self, *, fail: bool = False, bad: float = 0.0) -> None:
        self.replays, self.fail, self.bad = 0, fail, bad

    def __call__(self, step):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        out = step().clone()

        def replay():
            self.replays += 1
            out.copy_(step() + self.bad)
            return out

        return replay


def timer_of(graph_ms: float, eager_ms: float):
    """An injected timer: the graph side is the function that copies ids into the static batch."""
    def timer(fn, runs):
        return graph_ms if getattr(fn, "__name__", "") == "graph_run" else eager_ms
    return timer


def with_graphs(runner, mode="auto", *, capture=None, graph_ms=1.0, eager_ms=2.0):
    graphs = GraphSet(mode, runner.device, capture=capture or Recorder(), timer=timer_of(graph_ms, eager_ms))
    model = runner.model
    line = graphs.capture_all(lambda b: model(b.input_ids, b.positions, b), vocab=runner.config.vocab_size,
                              dtype=runner.dtype)
    return dataclasses.replace(runner, graphs=graphs), line


def answer(runner, ids):
    return streams.settled(runner.run(runner.prepare(np.asarray(ids, np.int32), np.array([0, len(ids)], np.int32))))


LENGTHS = (1, 7, 16, 17, 33, 100, 128)


@pytest.fixture(scope="module")
def seq_cls_dir(fixture_root):
    import fixtures

    return fixtures.cached("tiny-qwen3-seq-cls-3", root=fixture_root)


@pytest.mark.parametrize("which", ["last-token", "mean", "reranker", "classifier"])
def test_padded_bucket_forward_equals_the_unpadded_one(which, tiny_embedding_dir, tiny_reranker_dir, seq_cls_dir):
    """fp32: every length up to the largest bucket, served through its bucket (padded at the end,
    the head at the real positions), answers what the eager unpadded forward answers."""
    model_dir = {"reranker": tiny_reranker_dir, "classifier": seq_cls_dir}.get(which, tiny_embedding_dir)
    eager = load_runner(str(model_dir), device="cpu", dtype="float32",
                        pooling=which if which in ("last-token", "mean") else None)
    assert eager.graphs is not None and not eager.graphs.enabled  # auto on a CPU: off
    served, _ = with_graphs(eager)
    recorder = served.graphs._capture
    rng = np.random.default_rng(3)
    for n in LENGTHS:
        ids = rng.integers(1, eager.config.vocab_size, n)
        before = recorder.replays
        got = answer(served, ids)
        assert recorder.replays == before + 1, n  # the graph path served it
        want = answer(eager, ids)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # not a lone short input: eager, still the same answer
    before = recorder.replays
    ids = rng.integers(1, eager.config.vocab_size, BUCKETS[-1] + 1)
    torch.testing.assert_close(answer(served, ids), answer(eager, ids), rtol=1e-5, atol=1e-5)
    two = (np.asarray(rng.integers(1, 100, 10), np.int32), np.array([0, 4, 10], np.int32))
    torch.testing.assert_close(streams.settled(served.run(served.prepare(*two))),
                               streams.settled(eager.run(eager.prepare(*two))), rtol=1e-5, atol=1e-5)
    assert recorder.replays == before


def test_a_graph_batch_skips_the_prefix_cache_and_others_keep_it(tiny_embedding_dir):
    runner = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", prefix_cache_size="4096tokens")
    served, _ = with_graphs(runner)
    assert served.prepare(np.arange(1, 20, dtype=np.int32), np.array([0, 19], np.int32)).forward.cache is None
    big = np.arange(1, 200, dtype=np.int32)
    assert served.prepare(big, np.array([0, len(big)], np.int32)).forward.cache is not None


@pytest.mark.parametrize("graph_ms,eager_ms,mode,used", [(1.0, 2.0, "auto", True), (1.9, 2.0, "auto", True),
                                                         (1.99, 2.0, "auto", False), (3.0, 2.0, "auto", False),
                                                         (3.0, 2.0, "on", True)])
def test_auto_uses_a_bucket_only_where_it_measured_faster(graph_ms, eager_ms, mode, used, tiny_embedding_dir, caplog):
    runner = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32")
    served, line = with_graphs(runner, mode, graph_ms=graph_ms, eager_ms=eager_ms)
    report = served.graphs.report
    assert set(report["buckets"]) == {str(b) for b in BUCKETS}
    for why in report["buckets"].values():
        assert why.startswith("graph" if used else "eager (not faster") and f"{graph_ms:.3f} ms" in why
    assert served.graphs.fits(1, 20) == used and not served.graphs.fits(2, 20) and not served.graphs.fits(1, 129)
    assert report["state"].startswith("on for one input of up to 128 tokens" if used else "off (no bucket")
    assert line.startswith(f"CUDA graphs {report['state']}")
    # a graph reads its batch's device tensors at fixed addresses: the set holds each captured batch
    assert all(b.num_rows == length for length, (b, _) in served.graphs.replays.items())


def test_a_failing_capture_leaves_every_input_eager_with_the_reason(tiny_embedding_dir, caplog):
    runner = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32")
    with caplog.at_level(logging.WARNING, logger="models.graphs"):
        served, line = with_graphs(runner, capture=Recorder(fail=True))
    assert "capture at 16 tokens failed: RuntimeError: operation not permitted" in caplog.text
    assert served.graphs.report["state"].startswith("off (capture at 16 tokens failed")
    assert not served.graphs.fits(1, 5) and served.graphs.limit == 0
    ids = np.arange(1, 9)
    torch.testing.assert_close(answer(served, ids), answer(runner, ids))


def test_a_graph_that_differs_from_eager_is_not_used(tiny_embedding_dir):
    runner = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32")
    served, _ = with_graphs(runner, "on", capture=Recorder(bad=1e-2))
    assert all(w.startswith("eager (differs from eager by") for w in served.graphs.report["buckets"].values())
    assert served.graphs.limit == 0


def test_a_failing_replay_turns_graphs_off_and_answers_eagerly(tiny_embedding_dir, caplog):
    runner = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32")
    served, _ = with_graphs(runner)
    static, replay = served.graphs.replays[16]

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    served.graphs.replays[16] = (static, broken)
    ids = np.arange(1, 12)
    with caplog.at_level(logging.WARNING, logger="models.graphs"):
        got = answer(served, ids)
    torch.testing.assert_close(got, answer(runner, ids))
    assert "a replay failed: RuntimeError" in caplog.text and served.graphs.limit == 0
    assert served.graphs.report["state"].startswith("off (a replay failed")


def test_choose_rejects_nan_and_reports_the_figures():
    assert choose("on", diff=float("nan"), scale=1.0, tolerance=1e-4, graph_ms=1, eager_ms=2)[0] is False
    assert choose("auto", diff=0.0, scale=300.0, tolerance=1e-4, graph_ms=1, eager_ms=2) == (
        True, "faster: graph 1.000 ms, eager 2.000 ms")
    assert choose("auto", diff=0.02, scale=300.0, tolerance=1e-4, graph_ms=1, eager_ms=2)[0] is True  # relative
    assert choose("auto", diff=0.04, scale=300.0, tolerance=1e-4, graph_ms=1, eager_ms=2)[0] is False


def test_on_without_cuda_is_refused_in_one_line(tiny_embedding_dir):
    with pytest.raises(ValueError, match="--cuda-graphs on needs a CUDA device, and the model runs on cpu"):
        check_mode("on", torch.device("cpu"))
    check_mode("auto", torch.device("cpu"))
    runner = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", cuda_graphs="off")
    assert runner.report.cuda_graphs["state"] == "off (--cuda-graphs off)"
    auto = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32")
    assert auto.report.cuda_graphs["state"].startswith("off (the model runs on cpu")
    proc = subprocess.run([sys.executable, "-m", "server.cli", "--model-id", str(tiny_embedding_dir), "--device", "cpu",
                           "--cuda-graphs", "on", "--port", "0"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "could not start" in ln]
    assert len(lines) == 1 and "--cuda-graphs on needs a CUDA device" in lines[0], proc.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures real CUDA graphs")
def test_real_capture_matches_eager_on_cuda(tiny_embedding_dir):
    runner = load_runner(str(tiny_embedding_dir), device="cuda", dtype="float32", cuda_graphs="on",
                         prefix_cache_size=0)  # fp32: the padded bucket's rows held to a tight tolerance
    runner.warm_up(max_tokens=512)
    graphs = runner.graphs
    assert graphs is not None and graphs.limit == BUCKETS[-1], graphs.report
    eager = dataclasses.replace(runner, graphs=None)
    rng = np.random.default_rng(0)
    for n in LENGTHS:
        ids = rng.integers(1, runner.config.vocab_size, n)
        torch.testing.assert_close(answer(runner, ids), answer(eager, ids), rtol=1e-3, atol=1e-3)
    assert all(why.startswith("graph (on: ") for why in graphs.report["buckets"].values())
