"""Row-gather micro-benchmark: which gather wins for the K/V scatter of compact attention.

For the K/V shapes of Qwen3-0.6B/4B/8B (K and V each [N, Hkv*D], Hkv=8, D=128) and a compact
index (N' = N/2 rows gathered to N rows with repeats, laid out like groups of sequences sharing a
prefix), times a device-to-device copy of the output size (the ceiling), torch.index_select,
advanced indexing, torch.gather with an expanded index, and the custom kernel (single and pair),
from packed K/V and from the strided K/V slices of a fused QKV output (what the model runs since
qkv_proj is fused: K is a head slice of the rotated [T, H+Hkv, D] q/k, V one of the QKV output). Prints GB/s counting bytes
read + written (2 * rows_out * row_bytes per tensor) and the share of the copy ceiling.

Invariant: figures on CPU are only a smoke test and are labelled "cpu, not meaningful".
Usage: python -m benchmarks.bench_kernels [--sizes 8192,32768,70000] [--json PATH|-]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass

import torch

# name -> (query heads, kv heads, head_dim): the fused QKV row is (H + 2*Hkv) * D wide.
MODELS = {"qwen3-0.6b": (16, 8, 128), "qwen3-4b": (32, 8, 128), "qwen3-8b": (32, 8, 128)}
GROUP, SEQ_LEN, SHARED = 4, 384, 256  # 4 sequences share 256 of 384 tokens: N'/N = 1/2


@dataclass(frozen=True)
class Case:
    model: str
    rows_out: int  # N
    rows_src: int  # N'
    heads: int
    kv_heads: int
    head_dim: int


def compact_index(n: int, device) -> tuple[torch.Tensor, int]:
    """Index [N] into N' = N/2 compact rows: full row (group, seq, t) -> its trie node."""
    groups = max(1, round(n / (GROUP * SEQ_LEN)))
    t = torch.arange(SEQ_LEN)
    per_group = SHARED + GROUP * (SEQ_LEN - SHARED)
    rows = []
    for s in range(GROUP):  # [GROUP, L] compact row within a group
        rows.append(torch.where(t < SHARED, t, SHARED + s * (SEQ_LEN - SHARED) + (t - SHARED)))
    one = torch.stack(rows).reshape(-1)
    index = (torch.arange(groups)[:, None] * per_group + one[None, :]).reshape(-1)  # [N]
    return index.to(device=device, dtype=torch.int32), groups * per_group


class Timer:
    """Median milliseconds of fn(); CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device, *, warmup: int, reps: int):
        self.device, self.warmup, self.reps = device, warmup, reps

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            for _ in range(self.reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        else:
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def _methods(case: Case, device, dtype, ext):
    """(method, source layout, tensors, fn) for one case; sources rotate past the L2 cache."""
    h, hkv, d = case.heads, case.kv_heads, case.head_dim
    width = hkv * d
    index, _ = compact_index(case.rows_out, device)
    idx64 = index.long()
    elem = torch.tensor([], dtype=dtype).element_size()
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0
    sets = max(1, -(-2 * l2 // max(1, case.rows_src * width * elem)))
    qkv = [torch.randn(case.rows_src, (h + 2 * hkv) * d, device=device, dtype=dtype) for _ in range(sets)]
    packed = [x[:, h * d:h * d + width].contiguous() for x in qkv]  # [N', Hkv*D]
    packed_v = [x[:, h * d + width:].contiguous() for x in qkv]
    strided_k = [x[:, h * d:h * d + width] for x in qkv]  # row stride (H+2Hkv)*D
    strided_v = [x[:, h * d + width:] for x in qkv]
    full = [torch.randn(case.rows_out, width, device=device, dtype=dtype) for _ in range(sets)]
    dst = torch.empty(case.rows_out, width, device=device, dtype=dtype)
    expand = idx64[:, None].expand(case.rows_out, width)
    turn = [0]

    def nxt() -> int:  # rotate input sets so repeated calls do not measure the L2 cache
        turn[0] = (turn[0] + 1) % sets
        return turn[0]

    def select_pair():
        i = nxt()
        return strided_k[i].index_select(0, index), strided_v[i].index_select(0, index)

    def select_pair_packed():
        i = nxt()
        return packed[i].index_select(0, index), packed_v[i].index_select(0, index)

    out = [
        ("copy", "packed", 1, lambda: dst.copy_(full[nxt()])),
        ("index_select", "packed", 1, lambda: packed[nxt()].index_select(0, index)),
        ("advanced_indexing", "packed", 1, lambda: packed[nxt()][idx64]),
        ("torch.gather", "packed", 1, lambda: torch.gather(packed[nxt()], 0, expand)),
        ("index_select", "strided", 1, lambda: strided_k[nxt()].index_select(0, index)),
        ("index_select x2 (K,V)", "strided", 2, select_pair),
        ("index_select x2 (K,V)", "packed", 2, select_pair_packed),
    ]
    if ext is not None:
        def kernel_pair():
            i = nxt()
            return ext.gather_rows_pair(strided_k[i], strided_v[i], index)

        def kernel_pair_packed():
            i = nxt()
            return ext.gather_rows_pair(packed[i], packed_v[i], index)

        out += [
            ("kernel", "packed", 1, lambda: ext.gather_rows(packed[nxt()], index)),
            ("kernel", "strided", 1, lambda: ext.gather_rows(strided_k[nxt()], index)),
            ("kernel pair (K,V)", "strided", 2, kernel_pair),
            ("kernel pair (K,V)", "packed", 2, kernel_pair_packed),
        ]
    if ext is not None:  # correctness before timing: the kernel must equal index_select
        for src in (packed[0], strided_k[0]):
            if not torch.equal(ext.gather_rows(src, index), src.index_select(0, index)):
                raise AssertionError(f"gather kernel differs from index_select for {case}")
        pk, pv = ext.gather_rows_pair(strided_k[0], strided_v[0], index)
        if not (torch.equal(pk, strided_k[0][idx64]) and torch.equal(pv, strided_v[0][idx64])):
            raise AssertionError(f"gather kernel pair differs from indexing for {case}")
    return out, width * elem


def run(cases, *, device, dtype, warmup: int, reps: int, ext) -> list[dict]:
    timer = Timer(device, warmup=warmup, reps=reps)
    records = []
    for case in cases:
        methods, row_bytes = _methods(case, device, dtype, ext)
        ceiling = None
        for name, layout, tensors, fn in methods:
            ms = timer(fn)
            nbytes = 2 * case.rows_out * row_bytes * tensors
            gbps = nbytes / (ms * 1e-3) / 1e9
            ceiling = gbps if name == "copy" else ceiling
            records.append({
                "model": case.model, "rows_out": case.rows_out, "rows_src": case.rows_src,
                "method": name, "source": layout, "tensors": tensors, "row_bytes": row_bytes,
                "bytes": nbytes, "ms": ms, "gb_per_s": gbps, "pct_copy": 100.0 * gbps / ceiling,
            })
    return records


def format_table(records: list[dict], label: str) -> str:
    lines = [f"# row gather, {label}",
             f"{'model':<11} {'N':>7} {'method':<22} {'source':<8} {'ms':>9} {'GB/s':>8} {'%copy':>6}"]
    for r in records:
        lines.append(f"{r['model']:<11} {r['rows_out']:>7} {r['method']:<22} {r['source']:<8} "
                     f"{r['ms']:>9.4f} {r['gb_per_s']:>8.1f} {r['pct_copy']:>6.1f}")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_kernels", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="8192,32768,70000", help="N (output rows), comma separated")
    p.add_argument("--models", default=",".join(MODELS), help="comma separated: " + ", ".join(MODELS))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke test)")
    p.add_argument("--no-kernel", action="store_true", help="skip building/timing the custom kernel")
    p.add_argument("--json", nargs="?", const="-", default=None, help="write records as JSON (- = stdout)")
    args = p.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    tiny = args.tiny or device.type != "cuda"
    sizes = [GROUP * SEQ_LEN] if tiny else [int(s) for s in args.sizes.split(",")]
    cases = []
    for model in args.models.split(","):
        h, hkv, d = MODELS[model]
        if tiny:
            h, hkv, d = h // 8, hkv // 4, d // 8  # keep the fused-row ratio, shrink the row
        for n in sizes:
            _, n_src = compact_index(n, "cpu")
            rows_out = max(1, round(n / (GROUP * SEQ_LEN))) * GROUP * SEQ_LEN
            cases.append(Case(model, rows_out, n_src, heads=h, kv_heads=hkv, head_dim=d))

    ext = None
    if device.type == "cuda" and not args.no_kernel:
        from kernels import gather

        ext = gather.load_extension()
        if ext is None:
            print(f"custom kernel unavailable: {gather.load_error()}", file=sys.stderr)
    if device.type == "cuda":
        label = f"{torch.cuda.get_device_name(device)}, {args.dtype}, median of {args.reps}"
    else:
        label = f"cpu, not meaningful (smoke test only), {args.dtype}"
        torch.set_num_threads(1)
    records = run(cases, device=device, dtype=dtype, warmup=args.warmup, reps=args.reps, ext=ext)
    print(format_table(records, label))
    if args.json == "-":
        print(json.dumps({"label": label, "records": records}))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump({"label": label, "records": records}, f, indent=1)
    return records


if __name__ == "__main__":
    main()
