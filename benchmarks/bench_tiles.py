"""One attention block on the CPU: aten's flash kernel against the oneDNN tiles, side by side.

    python -m benchmarks.bench_tiles [--threads 1] [--rounds 5] [--clock cpu|wall]

Prints the GEMM rate of MKL (`torch.mm`) and oneDNN (`mkldnn._linear_pointwise`, the packed
linears' op) on one 256 x 2048 x 128 product, then, for blocks in the 0.6B model's head layout
(16 query heads, 8 K/V heads, head dim 128), the median ms and useful GFLOP/s of both kernels
(alternating call by call, round 0 not counted) and their ratio. The blocks are the ones the
tree and the flat path make at B=16 P=2048 S=128 (docs/decisions.md, "CPU attention tiles"), a long
input's causal block, and the threshold's neighbourhood. Nothing is asserted: a tool.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from models.attention.lse import flash_lse
from models.attention.tiles import tiled_lse

H, HKV, D = 16, 8, 128
BLOCKS = (  # name, g, Lq, Lk, causal
    ("prefix owner, causal 2176", 1, 2176, 2176, True),
    ("tree: shared prefix 1920 x 2048", 1, 1920, 2048, False),
    ("flat: one owner's prefix 128 x 2048", 1, 128, 2048, False),
    ("long input, causal 4096", 1, 4096, 4096, True),
    ("causal 2048 (threshold: 4.2M pairs)", 1, 2048, 2048, True),
    ("1024 x 2048 (threshold: 4.2M pairs)", 1, 1024, 2048, False),
)


def _median_ms(fns: dict, rounds: int, clock) -> dict[str, float]:
    times: dict[str, list[float]] = {n: [] for n in fns}
    for r in range(rounds + 1):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            if r:
                times[name].append((clock() - t0) * 1e3)
    return {n: statistics.median(t) for n, t in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    lin = torch.ops.mkldnn._linear_pointwise
    with torch.inference_mode():
        x, w = torch.randn(256, 128), torch.randn(2048, 128)
        ms = _median_ms({"mkl": lambda: [torch.mm(x, w.t()) for _ in range(20)],
                         "onednn": lambda: [lin(x, w, None, "none", [], "") for _ in range(20)]},
                        args.rounds, clock)
        flops = 20 * 2 * 256 * 2048 * 128
        print(f"GEMM 256 x 2048 x 128, {args.threads} thread(s), {args.clock} clock: MKL "
              f"{flops / ms['mkl'] / 1e6:.0f} GFLOP/s, oneDNN {flops / ms['onednn'] / 1e6:.0f} GFLOP/s")
        print("| block | flash ms | GFLOP/s | tiles ms | GFLOP/s | tiles speed-up |\n|---|---|---|---|---|---|")
        for name, g, lq, lk, causal in BLOCKS:
            q, k, v = torch.randn(g, H, lq, D), torch.randn(g, HKV, lk, D), torch.randn(g, HKV, lk, D)
            pairs = g * (lq * (lq + 1) // 2 if causal else lq * lk)
            flops = pairs * H * 4 * D  # QK^T and PV, every head
            s = D ** -0.5
            ms = _median_ms({"flash": lambda: flash_lse(q, k, v, causal=causal, scale=s),
                             "tiles": lambda: tiled_lse(q, k, v, causal=causal, scale=s)},
                            args.rounds, clock)
            print(f"| {name} | {ms['flash']:.1f} | {flops / ms['flash'] / 1e6:.0f} | {ms['tiles']:.1f} | "
                  f"{flops / ms['tiles'] / 1e6:.0f} | {ms['flash'] / ms['tiles']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
