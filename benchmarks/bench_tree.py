"""Tree attention against the flat compact path: forward time and the keys each path materialises.

    python -m benchmarks.bench_tree forward [--layers 2] [--rounds 5]   # B=16, P in 0/512/2048, S=128
    python -m benchmarks.bench_tree rerank  [--layers 2] [--rounds 3]   # 1 query, 10/64 passages
    python -m benchmarks.bench_tree long    [--layers 2]                # 16k tokens: cache hit vs miss
    python -m benchmarks.bench_tree _long SIZE TREE [--models-root DIR]  # one case of it
    python -m benchmarks.bench_tree ceiling                             # GFLOP/s of the pieces

Invariant: the two paths run the same prepared batches in one process, alternating call by call
(flat, tree, flat, tree, ...), so a shared machine's load hits both alike; the figures are
medians of the process's CPU time (time.process_time: on a machine shared with other jobs, wall
time mostly measures the waiting), nothing is asserted. The model is the Qwen3-0.6B layer shape with `--layers` layers
(random weights, fixtures/): a per-layer ratio, not the 28-layer latency. `long` runs each
case in its own process (peak RSS is per process).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from models.runner import Runner


def _pack(seqs):
    ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    cu = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int32)
    return ids, cu


def _keys_mib(runner: Runner, prepared) -> float:
    """K/V rows one layer materialises for attention beyond the source rows, in MiB: the flat
    path gathers every owner's whole path; the tree path gathers none (views of the source)."""
    fb = prepared.forward
    if fb.tree is not None:
        return 0.0
    cfg = runner.config
    rows = int(fb.attn.host_cu_seqlens_k[-1])
    return rows * 2 * cfg.num_key_value_heads * cfg.head_dim * 4 / 2**20


def alternate(runners: dict[str, Runner], seqs, rounds: int) -> dict[str, dict]:
    """{name: {"ms": median forward ms, "prepare_ms": median, "tree": bool, "keys_mib": float}}."""
    ids, cu = _pack(seqs)
    times: dict[str, list[float]] = {n: [] for n in runners}
    preps: dict[str, list[float]] = {n: [] for n in runners}
    info = {}
    for r in range(rounds + 1):  # round 0 warms both up and is not counted
        for name, runner in runners.items():
            t0 = _clock()
            prepared = runner.prepare(ids, cu)
            t1 = _clock()
            runner.run(prepared)
            t2 = _clock()
            if r:
                preps[name].append((t1 - t0) * 1e3)
                times[name].append((t2 - t1) * 1e3)
            info[name] = {"tree": prepared.forward.tree is not None,
                          "keys_mib": _keys_mib(runner, prepared), "rows": prepared.n_compact}
    return {n: {"ms": statistics.median(times[n]), "prepare_ms": statistics.median(preps[n]),
                **info[n]} for n in runners}


def attention_alone(runners: dict[str, Runner], seqs, rounds: int) -> dict[str, float]:
    """{name: median ms} of layer 0's attention alone (random q/k/v in the model's head shapes,
    q and k as strided views of one fused tensor, as the layer passes them), alternating."""
    ids, cu = _pack(seqs)
    attn: Any = next(iter(runners.values())).model.layers[0].self_attn
    batches = {n: r.prepare(ids, cu).forward for n, r in runners.items()}
    rows = next(iter(batches.values())).num_rows
    qkv = torch.randn(rows, attn.heads + 2 * attn.kv_heads, attn.head_dim)  # [T, H+2Hkv, D]
    q, k = qkv[:, :attn.heads], qkv[:, attn.heads:attn.heads + attn.kv_heads]
    v = qkv[:, attn.heads + attn.kv_heads:]
    times: dict[str, list[float]] = {n: [] for n in runners}
    with torch.inference_mode():
        for r in range(rounds + 1):
            for name, fb in batches.items():
                t0 = _clock()
                attn.attend(q, k, v, fb)
                if r:
                    times[name].append((_clock() - t0) * 1e3)
    return {n: statistics.median(t) for n, t in times.items()}


def _pair(model: str, layers: int, kind: str | None = None) -> dict[str, Runner]:
    import fixtures
    from models.runner import load_runner

    path = fixtures.cached(model, layers=layers, kind=kind)
    base = load_runner(str(path), device="cpu", dtype="float32", prefix_cache_size=0,
                       radix_mlp_threshold=1.0)
    _force_kernel(base.report.cpu_attention)
    return {"flat": dataclasses.replace(base, tree_attention="off"),
            "tree": dataclasses.replace(base, tree_attention="auto")}


_KERNEL = {"force": "measured"}
_CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
_CLOCK = {"name": "cpu"}


def _clock() -> float:
    """The benchmark's clock: the process's CPU time (default) or wall time (--clock wall)."""
    return _CLOCKS[_CLOCK["name"]]()


def _force_kernel(report: str) -> None:
    """Keep the load's choice of CPU attention kernel, or override it (--kernel), and say which."""
    if _KERNEL["force"] != "measured":  # for side-by-side tables of the two kernels
        from models.attention import tiles as attention_tiles
        attention_tiles.set_enabled(_KERNEL["force"] == "tiles")
    print(f"CPU attention blocks: {report}; this run: {_KERNEL['force']}", file=sys.stderr, flush=True)


def _row(label: str, res: dict, alone: dict[str, float]) -> str:
    f, t = res["flat"], res["tree"]
    return (f"| {label} | {f['rows']} | {'tree' if t['tree'] else 'flat'} | {f['ms']:.0f} | "
            f"{t['ms']:.0f} | {f['ms'] / t['ms']:.2f}x | {alone['flat']:.1f} | {alone['tree']:.1f} | "
            f"{alone['flat'] / alone['tree']:.2f}x | {f['keys_mib']:.0f} | {t['keys_mib']:.0f} |")


HEADER = ("| shape | compact rows | auto chose | forward flat ms | forward tree ms | speed-up | "
          "attention flat ms | attention tree ms | speed-up | keys gathered flat MiB/layer | "
          "tree MiB/layer |\n|---|---|---|---|---|---|---|---|---|---|---|")


def forward(args) -> None:
    runners = _pair("qwen3-0.6b", args.layers)
    rng = np.random.default_rng(0)
    print(HEADER)
    for p in (0, 512, 2048):
        prefix = rng.integers(100, 5000, p).tolist()
        seqs = [prefix + rng.integers(100, 5000, 128).tolist() for _ in range(16)]
        res = alternate(runners, seqs, args.rounds)
        alone = attention_alone(runners, seqs, 2 * args.rounds + 1)
        print(_row(f"B=16 P={p} S=128", res, alone), flush=True)


def rerank(args) -> None:
    """MS MARCO's shape: one query, 10 or 64 passages of ~50-100 tokens, in the reranker template."""
    runners = _pair("qwen3-0.6b", args.layers, kind="reranker")
    tok = runners["flat"].tokenizer
    rng = np.random.default_rng(1)
    from models.text.prompts import RERANK_PREFIX, RERANK_SUFFIX  # noqa: PLC0415

    head = tok.encode(RERANK_PREFIX, add_special_tokens=False).ids
    tail = tok.encode(RERANK_SUFFIX, add_special_tokens=False).ids
    print(HEADER)
    for lq in (32, 512, 4096):
        query = rng.integers(100, 5000, lq).tolist()
        for n in (10, 64):
            seqs = [head + query + rng.integers(100, 5000, int(rng.integers(50, 101))).tolist() + tail
                    for _ in range(n)]
            rounds = max(1, args.rounds if lq * n < 100_000 else args.rounds // 2)
            res = alternate(runners, seqs, rounds)
            alone = attention_alone(runners, seqs, 2 * rounds + 1)
            print(_row(f"query {lq}, {n} passages", res, alone), flush=True)


def _status_kib(field: str) -> int:
    """A /proc/self/status field in KiB (VmRSS: resident now; VmHWM: the peak since the reset)."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak_rss() -> int:
    """Reset the process's peak RSS to its current RSS (Linux clear_refs 5) and return it, KiB.
    NOTE: not ru_maxrss: the load's kernel measurement peaks above what stays resident, which
    would hide that much of a later peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS")


def _long_case(size: str, tree: str, layers: int) -> None:
    """One process: a 20-token instruction cached, then a 16,384-token input that shares it.
    tree "-": the code under test has no tree attention (an older checkout, --models-root)."""
    import fixtures
    from models.runner import load_runner

    extra: dict[str, Any] = {} if tree == "-" else {"tree_attention": tree}
    runner = load_runner(str(fixtures.cached("qwen3-0.6b", layers=layers)), device="cpu",
                         dtype="float32", prefix_cache_size=size, **extra)
    _force_kernel(getattr(getattr(runner, "report", runner), "cpu_attention", "-"))  # older: on the runner
    rng = np.random.default_rng(0)
    head = rng.integers(100, 5000, 20).tolist()
    runner.run(runner.prepare(*_pack([head + rng.integers(100, 5000, 12).tolist()])))
    cache = getattr(runner, "prefix_cache", None)
    if cache is not None:  # the pool's pages resident, as in a server that has run a while: the
        cache.k.fill_(0)   # 16k input's blocks written to it then cost no new pages, and the
        cache.v.fill_(0)   # peak below is the forward's own (the pool is sized by its flag)
    base = _reset_peak_rss()
    t0 = _clock()
    runner.run(runner.prepare(*_pack([head + rng.integers(100, 5000, 16384 - 20).tolist()])))
    dt = _clock() - t0
    peak = _status_kib("VmHWM")
    print(f"| cache {size}, tree {tree} | {dt:.1f} | +{(peak - base) / 1024:.0f} |", flush=True)


def long(args) -> None:
    print("| case | seconds | peak RSS MiB |\n|---|---|---|")
    for _ in range(args.rounds):
        for size, tree in (("auto", "auto"), ("0", "auto"), ("auto", "off")):
            subprocess.run([sys.executable, "-m", "benchmarks.bench_tree", "_long", size, tree,
                            "--layers", str(args.layers), "--threads", str(args.threads),
                            "--kernel", args.kernel, "--clock", args.clock], check=True)


def _gemm_unmasked(q, k, v, scale: float, rows: int = 128):
    """The unmasked block as chunked GEMMs (scores, in-place softmax, times V), for comparison
    with the flash kernel: q [Hkv, M, D] (query heads folded), k/v [Hkv, Lk, D]."""
    out = torch.empty_like(q)
    for a in range(0, q.shape[1], rows):
        s = torch.bmm(q[:, a:a + rows] * scale, k.transpose(1, 2))  # [Hkv, rows, Lk]
        m = s.amax(-1, keepdim=True)
        s.sub_(m).exp_()
        out[:, a:a + rows] = torch.bmm(s, v).div_(s.sum(-1, keepdim=True))  # [Hkv, rows, D]
    return out


def ceiling(args) -> None:
    """Layer attention at B=16 P=2048 S=128 (Qwen3-0.6B heads): its FLOPs, this CPU's sgemm
    rate, and the rate of each kernel call the tree path makes (process time, median of 3)."""
    from models.attention.lse import block_lse  # noqa: PLC0415

    def rate(flops: float, fn) -> tuple[float, float]:
        fn()
        ts = []
        for _ in range(3):
            t0 = _clock()
            fn()
            ts.append(_clock() - t0)
        ms = statistics.median(ts) * 1e3
        return ms, flops / ms / 1e6

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    print(f"sgemm 1024^3: {rate(2 * 1024 ** 3 * 8, lambda: [a @ b for _ in range(8)])[1]:.1f} GFLOP/s")
    h, hkv, d, s = 16, 8, 128, 128 ** -0.5
    per_pair = h * 4 * d  # QK^T and PV, every head
    calls = {  # name: (queries [g, H, Lq, D], keys [g, Hkv, Lk, D], causal, query-key pairs)
        "prefix owner, causal 2176": ((1, h, 2176), (1, hkv, 2176), True, 2176 * 2177 // 2),
        "shared prefix, 1920 x 2048": ((1, h, 1920), (1, hkv, 2048), False, 1920 * 2048),
        "15 own blocks, causal 128": ((15, h, 128), (15, hkv, 128), True, 15 * 128 * 129 // 2)}
    total = 0.0
    for name, (qs, ks, causal, pairs) in calls.items():
        q, k, v = torch.randn(*qs, d), torch.randn(*ks, d), torch.randn(*ks, d)
        ms, gf = rate(pairs * per_pair, lambda: block_lse(q, k, v, causal=causal, scale=s))
        total += pairs * per_pair
        print(f"flash {name}: {ms:.0f} ms, {gf:.1f} GFLOP/s")
    q, k, v = torch.randn(hkv, 2 * 1920, d), torch.randn(hkv, 2048, d), torch.randn(hkv, 2048, d)
    ms, gf = rate(1920 * 2048 * per_pair, lambda: _gemm_unmasked(q, k, v, s))
    print(f"chunked GEMMs, shared prefix: {ms:.0f} ms, {gf:.1f} GFLOP/s")
    print(f"attention per layer: {total / 1e9:.1f} GFLOP")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("forward", "rerank", "long", "_long", "ceiling"))
    parser.add_argument("args", nargs="*")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kernel", choices=("measured", "flash", "tiles"), default="measured",
                        help="the CPU's attention blocks: as chosen at load, or forced")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="CPU time of the process (default: steadier on a shared box) or wall time")
    parser.add_argument("--models-root", default=None,
                        help="import models/ from this checkout (e.g. an older commit, for _long)")
    args = parser.parse_args(argv)
    if args.models_root:
        sys.path.insert(0, args.models_root)
    torch.set_num_threads(args.threads)
    _KERNEL["force"] = args.kernel
    _CLOCK["name"] = args.clock
    if args.what == "_long":
        size, tree = args.args
        _long_case(size, tree, layers=args.layers)
        return
    {"forward": forward, "rerank": rerank, "long": long, "ceiling": ceiling}[args.what](args)


if __name__ == "__main__":
    main()
