"""What an idle gap costs the next piece of work on this machine: a fixed unit of work timed back
to back ("hot") and after sleeping ("after idle"), in blocks taking turns.

    python -m benchmarks.bench_idle [--preset tiny-embedding] [--gaps 0,0.2,2,20] [--repeats 300]
        [--threads 2,1] [--busy 1] [--model-dir DIR] [--batch 8x60]

Two units: a pure-Python loop (no memory to speak of: what it shows is the CPU's own pace after
a sleep, not a cache refilled), and the one-input request's model work (``runner.prepare`` and
``runner.run`` of the instructed query of benchmarks/bench_front.py, prefix cache off). A
latency benchmark sends one request at a time, so every stage of a lone request runs "after
idle"; a throughput benchmark runs hot. ``--threads`` times the model unit at each of these
torch thread counts (what models/lone_choice.py chooses between); ``--busy N`` keeps N processes
spinning meanwhile (a neighbour's load: one torch thread descheduled stalls every parallel
region); ``--model-dir`` and ``--batch BxL`` time another checkpoint and a batch of B sequences
of L tokens. Prints p50 and p90 of the wall time per gap, and each p50 over the first gap's.
Nothing is asserted.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from loadtest import machine


def python_unit() -> int:
    x = 0
    for i in range(2000):
        x += i * i
    return x


def model_unit(preset: str, model_dir: str | None = None, batch: tuple[int, int] | None = None):
    """``prepare`` + ``run`` of the instructed query (``batch`` None), or of ``batch`` = (B, L): B
    sequences of L random token ids, on ``model_dir`` or else the preset's fixture."""
    import numpy as np
    import torch

    import fixtures
    import models
    from benchmarks.bench_front import ONE_INPUT

    where = model_dir if model_dir is not None else str(fixtures.cached(preset))
    runner = models.load_runner(where, device="cpu", prefix_cache_size=0)
    if batch is None:
        ids = torch.tensor(runner.tokenizer.encode(ONE_INPUT).ids)
        cu = torch.tensor([0, len(ids)])
    else:
        b, length = batch
        ids = torch.from_numpy(np.random.default_rng(0).integers(100, runner.config.vocab_size, b * length))
        cu = torch.arange(0, b * length + 1, length)  # [B+1]

    def unit():
        return runner.run(runner.prepare(ids, cu))

    return unit


def measure(unit, gaps_ms: list[float], repeats: int, rounds: int = 5,
            threads: int | None = None) -> dict[float, list[float]]:
    """Wall seconds of ``unit()`` after each gap. Each gap runs as a block of ``repeats / rounds``
    units (a CPU's pace after waking changes over milliseconds, so gaps must not interleave unit
    by unit), the blocks taking turns round by round. ``threads``: torch's thread count meanwhile."""
    if threads is not None:
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return measure(unit, gaps_ms, repeats, rounds)
        finally:
            torch.set_num_threads(before)
    times: dict[float, list[float]] = {g: [] for g in gaps_ms}
    per_block = max(1, repeats // rounds)
    for _ in range(rounds):
        for gap in gaps_ms:
            for _ in range(30):
                unit()  # each block starts hot
            for _ in range(per_block):
                if gap:
                    time.sleep(gap / 1e3)
                t0 = time.perf_counter()
                unit()
                times[gap].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-embedding")
    ap.add_argument("--gaps", default="0,0.2,2,20", help="idle gaps in ms before each timed unit (0: none)")
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--threads", default=None, help="torch thread counts for the model unit, e.g. 2,1 "
                                                    "(default: torch's own)")
    ap.add_argument("--busy", type=int, default=0, help="processes kept spinning while measuring")
    ap.add_argument("--model-dir", default=None, help="a checkpoint directory instead of the preset's fixture")
    ap.add_argument("--batch", default=None, help="BxL: B sequences of L random tokens instead of the query")
    args = ap.parse_args(argv)
    gaps = [float(g) for g in args.gaps.split(",")]
    batch = None
    if args.batch:
        try:
            b, length = (int(v) for v in args.batch.lower().split("x"))
        except ValueError:
            ap.error("--batch is BxL, e.g. 8x60")
        if min(b, length) < 1:
            ap.error("--batch is BxL, e.g. 8x60")
        batch = (b, length)
    model = model_unit(args.preset, args.model_dir, batch)
    what = "one-input" if batch is None else f"{batch[0]}x{batch[1]}"
    units = [("pure-Python loop", python_unit, None)]
    if args.threads is None:
        units.append((f"{what} prepare + run", model, None))
    else:
        for n in (int(t) for t in args.threads.split(",")):
            units.append((f"{what} prepare + run, {n} thread{'s' if n > 1 else ''}", model, n))
    host = machine.current()  # before the spinners: the load the machine had of its own
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        print(f"machine: {machine.line(host)}; {args.busy} busy process(es) beside it\n")
        print("| unit | idle gap before it, ms | p50 us | p90 us | p50 / hot p50 |")
        print("|---|---|---|---|---|")
        for name, unit, threads in units:
            times = measure(unit, gaps, args.repeats, threads=threads)
            hot = statistics.median(times[gaps[0]])
            for gap in gaps:
                xs = sorted(times[gap])
                p50, p90 = statistics.median(xs), xs[int(0.9 * (len(xs) - 1))]
                print(f"| {name} | {gap:g} | {p50 * 1e6:.0f} | {p90 * 1e6:.0f} | {p50 / hot:.2f} |")
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
