"""In-process forward steps: off / paper / compact at the paper's 2048/256 shape with the load
time and the peak memory per mode, and fp16 against bf16.

Rows come from benchmarks.bench_forward.bench (modes interleaved round by round, medians), so
they compare with docs/performance/gpu.md, "Forward: off vs paper vs compact, against the paper".
"""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.bench_forward import bench
from benchmarks.gpu_campaign import plan
from benchmarks.synthetic import MODES, synthetic_batch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _load(model_dir: Path, s: plan.Sizes, dtype: str, max_batch_tokens: int):
    from models.runner import load_runner

    _sync(s.device)
    t0 = time.perf_counter()
    runner = load_runner(str(model_dir), device=s.device, dtype=dtype, radix_mlp_threshold=1.0,
                         prefix_cache_size=0, max_batch_tokens=max_batch_tokens)
    _sync(s.device)
    return runner, time.perf_counter() - t0


def peak_memory(runner, s: plan.Sizes, tokens: int) -> dict:
    """Bytes allocated at the peak of one forward of a `tokens`-token batch (B sequences sharing a
    prefix, S own tokens each) per mode, above what was allocated before it; None on a CPU."""
    from models.batch import build_forward_batch
    from models.trie import build_index, positions_from_cu_seqlens

    b, suffix = s.batch, s.suffix
    prefix = max(0, tokens // b - suffix)
    ids, cu = synthetic_batch(b, prefix, suffix, vocab=runner.config.vocab_size, seed=0)
    index = build_index(ids, positions_from_cu_seqlens(cu), cu)
    out: dict[str, int | None] = {"tokens": int(cu[-1]), "prefix": prefix}
    for mode in MODES:
        fb = build_forward_batch(ids, cu, None if mode == "off" else index, mode=mode, device=runner.device,
                                 mean_pooling=False)
        if not s.device.startswith("cuda"):
            with torch.inference_mode():
                runner.forward(fb)
            out[mode] = None
            continue
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            runner.forward(fb)
        torch.cuda.synchronize()
        out[mode] = torch.cuda.max_memory_allocated() - base
        del fb
    return out


def forward_big(s: plan.Sizes, model_dir: Path, *, deadline_at: float) -> dict:
    """Load time, the off/paper/compact rows at P in s.prefixes, then peak memory at s.mem_tokens
    (each part skipped, and said so, when the deadline is near)."""
    runner, load_s = _load(model_dir, s, s.dtype, max(s.mem_tokens))
    out: dict = {"load_s": load_s, "attention_backend": runner.attention_backend,
                 "weights_bytes": (torch.cuda.memory_allocated() if s.device.startswith("cuda") else None),
                 "rows": [], "memory": [], "skipped": []}
    for p in s.prefixes:
        if time.time() > deadline_at - s.margin:
            out["skipped"].append(f"forward P={p}: deadline")
            continue
        rows = bench(runner, batch=s.batch, prefixes=[p], suffix=s.suffix, warmup=1, repeats=s.repeats, seed=0)
        out["rows"] += [asdict(r) for r in rows]
    for tokens in s.mem_tokens:
        if time.time() > deadline_at - s.margin:
            out["skipped"].append(f"memory {tokens} tokens: deadline")
            continue
        out["memory"].append(peak_memory(runner, s, tokens))
    return out


def dtypes(s: plan.Sizes, model_dirs: dict[str, Path], *, deadline_at: float) -> dict:
    """fp16 against bf16 at the largest P of s.prefixes (2048/256 on a GPU), off and compact."""
    out: dict = {"rows": [], "skipped": []}
    kinds = ("bfloat16", "float16") if s.device.startswith("cuda") else ("float32",)
    for role, model_dir in model_dirs.items():
        for dtype in kinds:
            if time.time() > deadline_at - s.margin:
                out["skipped"].append(f"{role} {dtype}: deadline")
                continue
            runner, load_s = _load(model_dir, s, dtype, s.batch * (max(s.prefixes) + s.suffix))
            rows = bench(runner, batch=s.batch, prefixes=[max(s.prefixes)], suffix=s.suffix, warmup=1,
                         repeats=s.repeats, seed=0, modes=("off", "compact"))
            out["rows"] += [asdict(r) | {"role": role, "dtype": dtype, "load_s": load_s} for r in rows]
            del runner
            if s.device.startswith("cuda"):
                torch.cuda.empty_cache()
    return out
