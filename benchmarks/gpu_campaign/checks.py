"""The `check` phase's steps: gpu_check under the phase's deadline, the fused model in bf16 and
fp16 against transformers at real depth in every radix mode, the forward's launches per layer,
and the prefix cache's speed.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from benchmarks.gpu_campaign import plan

ROOT = Path(__file__).resolve().parents[2]


def gpu_check(s: plan.Sizes, *, logs: Path, deadline_at: float) -> dict:
    """benchmarks.gpu_check into logs/gpu_check, its two pytest runs given what the deadline leaves
    (on a CPU: the build and attention report only). Returns its verdicts and summaries."""
    out = logs / "gpu_check"
    budget = deadline_at - time.time()
    argv = [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(out)]
    if s.device.startswith("cuda"):
        argv += ["--test-timeout", str(int(max(30, (budget - 150) / 2)))]
    else:
        argv += ["--skip-tests", "--skip-bench"]
    try:
        res = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=max(10, budget))
        rc, text = res.returncode, res.stdout + res.stderr
    except subprocess.TimeoutExpired as exc:  # recorded: its own report, if written, still counts
        partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rc, text = 124, f"{partial}\nstopped after {budget:.0f} s"
    (logs / "gpu_check.out").write_text(text)
    report = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").is_file() else {}
    keys = ("build", "attention", "tests", "serving", "bench")
    return {"rc": rc,
            "verdicts": {k: report[k].get("ok") for k in keys if k in report},
            "tests": report.get("tests", {}).get("summary"), "serving": report.get("serving", {}).get("summary"),
            "failures": report.get("tests", {}).get("failures", []) + report.get("serving", {}).get("failures", [])}


def _batch(seed: int = 0):
    """Groups of sequences sharing long prefixes, plus a duplicate and a one-token input."""
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(4):
        prefix = rng.integers(100, 5000, rng.integers(40, 160)).tolist()
        seqs += [prefix + rng.integers(100, 5000, rng.integers(1, 40)).tolist() for _ in range(4)]
    seqs += [seqs[0], [151643]]
    cu = np.concatenate([[0], np.cumsum([len(x) for x in seqs])]).astype(np.int32)
    return np.concatenate(seqs).astype(np.int32), cu, seqs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def exactness(s: plan.Sizes, model_dir: Path, *, deadline_at: float) -> dict:
    """Per half dtype and radix mode: |ours - transformers fp32| / |transformers fp32| beside
    transformers' own error in that dtype; ours passes within 2x theirs + 1e-3."""
    from transformers import AutoModel

    from models import streams
    from models.runner import load_runner

    ids, cu, seqs = _batch()
    dev = s.device

    def hf_last(dtype):
        hf = AutoModel.from_pretrained(str(model_dir), dtype=dtype).to(dev).eval()
        with torch.no_grad():
            last = torch.stack([hf(input_ids=torch.tensor([x], device=dev)).last_hidden_state[0, -1] for x in seqs])
        del hf
        return last.double().cpu()

    ref = hf_last(torch.float32)
    rows, skipped = [], []
    for dtype in ((torch.bfloat16, torch.float16) if dev.startswith("cuda") else (torch.bfloat16,)):
        if time.time() > deadline_at - s.margin:
            skipped.append(f"{dtype}: deadline")
            continue
        err_hf = _rel(hf_last(dtype), ref)
        for mode in ("off", "paper", "compact"):
            runner = load_runner(str(model_dir), device=dev, dtype=dtype,
                                 radix_attention="compact" if mode == "off" else mode, prefix_cache_size=0)
            runner = dataclasses.replace(runner, radix_mlp_threshold=0.0 if mode == "off" else 1.0)
            got = streams.settled(runner.run(runner.prepare(ids, cu)))
            assert isinstance(got, torch.Tensor)
            ours = got.double().cpu()
            err = _rel(ours, ref)
            rows.append({"dtype": str(dtype).replace("torch.", ""), "mode": mode, "rel_err": err,
                         "transformers_rel_err": err_hf, "ok": bool(err <= 2 * err_hf + 1e-3)})
            del runner
    return {"inputs": len(seqs), "rows": rows, "skipped": skipped}


def cache_speed(s: plan.Sizes, model_dir: Path, *, deadline_at: float) -> dict:
    """benchmarks.bench_cache's embedding workloads on the device: cache vs no cache vs radix off."""
    from benchmarks.bench_cache import bench, workload_batches
    from models.runner import load_runner

    runner = load_runner(str(model_dir), device=s.device, dtype=s.dtype, prefix_cache_size="auto")
    cuda = s.device.startswith("cuda")
    n = 30 if cuda else 2
    out, skipped = [], []
    for name in ("query", "embed-template", "chunks") if cuda else ("query", "chunks"):
        if time.time() > deadline_at - s.margin:
            skipped.append(f"{name}: deadline")
            continue
        k = max(2, n // 4) if name == "embed-template" else n
        out += [asdict(r) for r in bench(runner, workload_batches(name, runner, n=k + 1, seed=0), workload=name)]
    return {"rows": out, "skipped": skipped}


def launches(s: plan.Sizes, model_dir: Path) -> dict:
    """benchmarks.launch_count in the forward's dtype: the paper-shaped batch (radix off and
    compact) and one short request (what bounds its latency floor)."""
    from benchmarks import launch_count

    cuda = s.device.startswith("cuda")
    shapes = {"batch": (s.batch, s.prefixes[-1], s.suffix), "short": (1, 0, 16)}
    rows = []
    for name, (seqs, prefix, suffix) in shapes.items():
        res = launch_count.run(str(model_dir), device=s.device, dtype=s.dtype,
                               modes=["off", "compact"] if name == "batch" else ["compact"],
                               sequences=seqs, prefix=prefix, suffix=suffix)
        for mode, c in res["modes"].items():
            rows.append({"shape": name, "mode": mode, "unit": c["unit"], "tokens": c["tokens"],
                         "per_layer": c["per_layer"]["median"], "outside": c["outside_layers"], "total": c["total"],
                         "layer0": c["commonest_in_layer0"][:8]})
    return {"cuda": cuda, "rows": rows}
