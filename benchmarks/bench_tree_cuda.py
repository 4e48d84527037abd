"""Tree attention on against off on a GPU, over the whole forward, at the model's real depth.

    python -m benchmarks.bench_tree_cuda MODEL_DIR [--dtype bfloat16] [--rounds 10]

B sequences share one P-token prefix, each with its own S-token suffix (random ids), in four
shapes. Two runners of the same checkpoint (`tree_attention` "off" and "on", no prefix cache,
the trie always used) run each batch in turn, prepare + run + a device sync, round by round, so
the GPU's clocks and the host's load hit both alike; the first two rounds warm up and are not
counted. Prints the median milliseconds, their ratio, whether the tree plan was attached, and
the relative difference of the two paths' outputs. Figures only; nothing is asserted.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

SHAPES = ((32, 512, 256), (32, 2048, 256), (64, 1024, 64), (16, 4096, 128))  # (B, P, S)


def batch(b: int, p: int, s: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    prefix = rng.integers(1000, 100000, p)
    seqs = [np.concatenate([prefix, rng.integers(1000, 100000, s)]) for _ in range(b)]
    ids = np.concatenate(seqs).astype(np.int32)
    return ids, np.concatenate([[0], np.cumsum([len(q) for q in seqs])]).astype(np.int32)


def main(argv=None) -> None:
    from models import load_runner
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_tree_cuda",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)
    runners = {t: load_runner(args.model_dir, device=args.device, dtype=args.dtype, tree_attention=t,
                              prefix_cache_size=0, radix_mlp_threshold=1.0) for t in ("off", "on")}
    print("tree attention:", runners["on"].tree_report, flush=True)
    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)
    rng = np.random.default_rng(0)
    for b, p, s in SHAPES:
        ids, cu = batch(b, p, s, rng)
        times: dict[str, list[float]] = {t: [] for t in runners}
        outs, used = {}, False
        for rnd in range(args.rounds + 2):
            for name, runner in runners.items():
                sync()
                t0 = time.perf_counter()
                prepared = runner.prepare(ids, cu)
                out = runner.run(prepared)
                out = out.result() if hasattr(out, "result") else out
                sync()
                if rnd >= 2:
                    times[name].append(time.perf_counter() - t0)
                outs[name] = out.float()
                used |= name == "on" and prepared.forward.tree is not None
        diff = ((outs["off"] - outs["on"]).norm() / outs["off"].norm()).item()
        ms = {n: statistics.median(v) * 1e3 for n, v in times.items()}
        print(f"B={b} P={p} S={s}: off {ms['off']:.2f} ms, on {ms['on']:.2f} ms (tree attached: {used}), "
              f"off/on {ms['off'] / ms['on']:.2f}x, relative difference {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
