"""What one forward dispatches, per decoder layer: CUDA kernel launches on a GPU, top-level aten
ops on a CPU, counted by torch.profiler in each radix mode.

    python -m benchmarks.launch_count --model-dir DIR [--device cuda] [--dtype bfloat16]
        [--modes off compact paper] [--sequences 32] [--prefix 512] [--suffix 64]

On a GPU eager dispatch costs a few microseconds per launch on the one thread that launches, so
a short request's latency floor is about launches x that: the count says where fusing (RMSNorm,
rotary, SiLU x up, the residual adds) or graph capture would pay. Each layer's forward is wrapped
in a profiler range (``radixserve.layer.I``) by module hooks; a launch is a CUDA runtime launch
call (kernel, memcpy, memset) inside that range; on the CPU an op is an aten op with no aten parent inside it.
Prints JSON: per mode, launches per layer (min/median/max over layers), outside the layers, the
whole forward, and the commonest names in one layer.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import sys

import numpy as np
import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

LAYER_RANGE = "radixserve.layer."
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync",
                "cudaMemsetAsync", "cudaLaunchCooperativeKernel", "cudaGraphLaunch")


def batch(sequences: int, prefix: int, suffix: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``sequences`` inputs sharing a ``prefix``-token head, each with its own ``suffix`` tokens:
    flat ids int32 [N] and cu_seqlens int32 [B+1]."""
    rng = np.random.default_rng(seed)
    head = rng.integers(100, 5000, prefix).tolist()
    seqs = [head + rng.integers(100, 5000, suffix).tolist() for _ in range(sequences)]
    cu = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int32)
    return np.concatenate(seqs).astype(np.int32), cu


def _layer_ranges(layers: torch.nn.ModuleList) -> list:
    """Hooks that open a profiler range before each layer and close it after; returns handles."""
    handles = []
    for i, layer in enumerate(layers):
        rf = record_function(f"{LAYER_RANGE}{i}")

        def enter(module, args, rf=rf):
            rf.__enter__()

        def leave(module, args, out, rf=rf):
            rf.__exit__(None, None, None)

        handles += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    return handles


def _layer_of(event) -> int | None:
    """The decoder layer whose range encloses an event, or None outside every layer."""
    q = event.cpu_parent
    while q is not None:
        if q.name.startswith(LAYER_RANGE):
            return int(q.name[len(LAYER_RANGE):])
        q = q.cpu_parent
    return None


def _dispatches(events, cuda: bool) -> list:
    """What the forward dispatched: launch calls (CUDA), or aten ops with no aten parent (CPU)."""
    if cuda:
        return [e for e in events if e.name in LAUNCH_CALLS]
    return [e for e in events if e.name.startswith("aten::")
            and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]


def count(runner, ids: np.ndarray, cu: np.ndarray) -> dict:
    """Profile one forward of a prepared batch (after one warm-up forward) and count per layer."""
    from models import streams
    cuda = str(runner.device).startswith("cuda")
    streams.settled(runner.run(runner.prepare(ids, cu)))  # warm: kernels chosen, caches filled
    prepared = runner.prepare(ids, cu)
    layers = runner.model.layers
    handles = _layer_ranges(layers)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=activities) as prof:
            streams.settled(runner.run(prepared))
            if cuda:
                torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    events = prof.events()
    ranges = sum(1 for e in events if e.name.startswith(LAYER_RANGE))
    per_layer: list[list[str]] = [[] for _ in layers]
    outside = 0
    dispatched = _dispatches(events, cuda)
    for e in dispatched:
        i = _layer_of(e)
        if i is None:
            outside += 1
        else:
            per_layer[i].append(e.name)
    counts = [len(x) for x in per_layer]
    total = len(dispatched)
    return {"unit": "launches" if cuda else "aten ops", "layers": len(layers), "ranges": ranges,
            "per_layer": {"min": min(counts, default=0), "median": statistics.median(counts) if counts else 0,
                          "max": max(counts, default=0)},
            "per_layer_counts": counts, "outside_layers": outside, "total": total,
            "tokens": int(cu[-1]), "sequences": len(cu) - 1,
            "commonest_in_layer0": collections.Counter(per_layer[0]).most_common(12) if per_layer else []}


def run(model_dir: str, *, device: str, dtype: str, modes: list[str], sequences: int, prefix: int,
        suffix: int) -> dict:
    from models.runner import load_runner

    ids, cu = batch(sequences, prefix, suffix)
    out: dict = {"device": device, "dtype": dtype, "modes": {}}
    for mode in modes:
        runner = load_runner(model_dir, device=device, dtype=getattr(torch, dtype),
                             radix_attention="compact" if mode == "off" else mode, prefix_cache_size=0)
        runner = dataclasses.replace(runner, radix_mlp_threshold=0.0 if mode == "off" else 1.0)
        out["modes"][mode] = count(runner, ids, cu)
        del runner
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--modes", nargs="+", default=["off", "compact"], choices=["off", "compact", "paper"])
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--suffix", type=int, default=64)
    a = ap.parse_args(argv)
    print(json.dumps(run(a.model_dir, device=a.device, dtype=a.dtype, modes=a.modes, sequences=a.sequences,
                         prefix=a.prefix, suffix=a.suffix), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
