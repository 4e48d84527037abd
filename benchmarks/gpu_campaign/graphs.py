"""In-process step: one short input, CUDA graphs against eager, side by side (models/graphs.py).

One runner at the small role's shape (Qwen3-0.6B on a GPU), no prefix cache, warmed up with
``--cuda-graphs on`` so every bucket that checks exact is captured (the warm-up's own per-bucket
timings and verdicts are reported as /info would). Then, for one input length inside each
bucket, `prepare` + `run` + the copy to the host of a one-input batch is timed with the graphs and
with the same runner's eager path (``graphs=None``), the two taking turns request by request;
p50 and p99 in ms per side and eager p50 / graph p50. On a CPU (the rehearsal) graphs are off and
both sides run eagerly: the step's structure is what is rehearsed, not its figures.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.gpu_campaign import plan

LENGTHS = (12, 24, 60, 120)  # one input length inside each bucket (16, 32, 64, 128)


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q))


def one_input(s: plan.Sizes, model_dir: Path, *, deadline_at: float) -> dict:
    from models import streams
    from models.runner import load_runner

    cuda = s.device.startswith("cuda")
    runner = load_runner(str(model_dir), device=s.device, dtype=s.dtype, prefix_cache_size=0,
                         cuda_graphs="on" if cuda else "auto")
    runner.warm_up(max_tokens=4096)
    eager = dataclasses.replace(runner, graphs=None)
    requests = 150 if cuda else 3
    out: dict = {"cuda_graphs": dict(runner.report.cuda_graphs), "requests": requests, "rows": [], "skipped": []}
    rng = np.random.default_rng(0)
    for n in LENGTHS:
        if time.time() > deadline_at - s.margin:
            out["skipped"].append(f"{n} tokens: deadline")
            continue
        times: dict[str, list[float]] = {"graph": [], "eager": []}
        cu = np.array([0, n], dtype=np.int32)
        for i in range(requests + 2):  # the first round of each side is not counted
            ids = rng.integers(1, runner.config.vocab_size, n).astype(np.int32)  # never a repeat
            for name, r in (("graph", runner), ("eager", eager)) if i % 2 else (("eager", eager), ("graph", runner)):
                t0 = time.perf_counter()
                streams.settled(r.run(r.prepare(ids, cu)))
                if i >= 2:
                    times[name].append(time.perf_counter() - t0)
        row = {"tokens": n, "served_by_graph": bool(runner.graphs and runner.graphs.fits(1, n))}
        for name, xs in times.items():
            row[f"{name}_p50_ms"], row[f"{name}_p99_ms"] = _pct(xs, 50), _pct(xs, 99)
        row["eager_over_graph"] = row["eager_p50_ms"] / row["graph_p50_ms"]
        out["rows"].append(row)
    if cuda:
        torch.cuda.synchronize()
    return out
