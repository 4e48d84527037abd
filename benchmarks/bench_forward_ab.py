"""Tools for measuring a change to the model code: A/B timing, ops per layer, attention paths.

Used by ``python -m benchmarks.bench forward`` with ``--ab OLD_ROOT``, ``--count-ops`` and
``--attention-ab`` (see benchmarks/bench_forward.py). Invariant: every comparison runs in one
process with the contenders alternating call by call, so a shared machine's load hits both alike;
figures only, nothing is asserted.
"""
from __future__ import annotations

import statistics
import time

import torch

from benchmarks.synthetic import MODES, synthetic_batch
from models.batch import build_forward_batch
from models.runner import Runner
from models.trie import build_index, positions_from_cu_seqlens


def ops_per_layer(runner: Runner, fb) -> dict[str, int]:
    """Top-level aten ops dispatched inside layer 0's forward: {op name: count} (CPU profiler).

    Only ops called directly by the layer's Python code count (an aten op's own sub-ops are
    its implementation, not extra launches); the attention backend's ops count as they come.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    layer = runner.model.layers[0]
    inner = layer.forward

    def marked(*args, **kwargs):
        with record_function("radixserve::layer0"):
            return inner(*args, **kwargs)

    layer.forward = marked
    try:
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            runner.forward(fb)
    finally:
        del layer.forward
    events = list(prof.events())
    mark = next(e for e in events if e.name == "radixserve::layer0")
    lo, hi = mark.time_range.start, mark.time_range.end
    # NOTE: mkldnn:: too: the CPU's packed linears (models/linear/packed.py) are oneDNN ops
    inside = [e for e in events if e.name.startswith(("aten::", "mkldnn::")) and lo <= e.time_range.start
              and e.time_range.end <= hi]
    # top level: an aten op not nested in another aten op of the layer
    top = [e for e in inside if not any(o is not e and o.time_range.start <= e.time_range.start
                                        and e.time_range.end <= o.time_range.end
                                        and (o.time_range.start, o.time_range.end)
                                        != (e.time_range.start, e.time_range.end)
                                        for o in inside)]
    counts: dict[str, int] = {}
    for e in top:
        counts[e.name] = counts.get(e.name, 0) + 1
    return counts


# Ops that only make views or no-op casts: they launch no kernel on a GPU.
VIEW_OPS = frozenset({"aten::view", "aten::slice", "aten::transpose", "aten::expand", "aten::chunk",
                      "aten::split", "aten::narrow", "aten::select", "aten::unsqueeze",
                      "aten::as_strided", "aten::to", "aten::reshape", "aten::t", "aten::alias",
                      "aten::detach"})


def count_ops(runner: Runner, *, batch: int, prefix: int, suffix: int, seed: int) -> dict:
    """{mode: {"total": n, "ops": {name: count}}} for one synthetic batch."""
    ids, cu = synthetic_batch(batch, prefix, suffix, vocab=runner.config.vocab_size, seed=seed)
    index = build_index(ids, positions_from_cu_seqlens(cu), cu)
    out = {}
    for mode in MODES:
        fb = build_forward_batch(ids, cu, None if mode == "off" else index, mode=mode,
                                 device=runner.device)
        ops = ops_per_layer(runner, fb)
        out[mode] = {"total": sum(ops.values()),
                     "compute": sum(v for k, v in ops.items() if k not in VIEW_OPS),
                     "ops": dict(sorted(ops.items()))}
    return out


def _module_from(path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def old_model(runner: Runner, old_root, model_dir: str):
    """The same checkpoint loaded by another checkout's Qwen3 family and weight loader (either layout).

    NOTE: the old files are executed against *this* checkout's models.checkpoint.config/batch/attention
    and kernels (their imports), so this fits changes confined to those two files.
    """
    from pathlib import Path

    root = Path(old_root)

    def first(*paths: str) -> Path:  # the file where that checkout's layout keeps it
        return next((root / p for p in paths if (root / p).is_file()), root / paths[0])

    qwen3 = _module_from(first("models/families/qwen3.py", "models/qwen3.py"), "ab_old_qwen3")
    loader = _module_from(first("models/checkpoint/loader.py", "models/loader.py"), "ab_old_loader")
    ker = runner.model.layers[0].self_attn.ops
    ops_class = getattr(qwen3, "AttentionOps", None) or qwen3.Kernels  # a checkout before the rename
    kernels = ops_class(ker.attention, ker.gather_rows, ker.gather_rows_pair)
    with torch.device("meta"):
        model = qwen3.Qwen3Model(runner.config, kernels, rope_device=runner.device,
                                 lm_head=runner.kind == "reranker")
    loader.load_weights(model, model_dir, device=runner.device, dtype=runner.dtype)
    return model.eval()


def ab(runner: Runner, old, *, batch: int, prefixes: list[int], suffix: int, warmup: int,
       repeats: int, seed: int) -> list[dict]:
    """Median ms of old vs new model forward per (prefix, mode); old/new alternate every call."""
    cuda = runner.device.type == "cuda"
    models = {"old": old, "new": runner.model}
    rows = []
    for prefix in prefixes:
        ids, cu = synthetic_batch(batch, prefix, suffix, vocab=runner.config.vocab_size, seed=seed)
        index = build_index(ids, positions_from_cu_seqlens(cu), cu)
        for mode in MODES:
            fb = build_forward_batch(ids, cu, None if mode == "off" else index, mode=mode,
                                     device=runner.device)
            times: dict[str, list[float]] = {"old": [], "new": []}
            outs = {}
            with torch.inference_mode():
                for k in range(warmup + repeats):
                    order = ("old", "new") if k % 2 == 0 else ("new", "old")
                    for label in order:
                        if cuda:
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        outs[label] = models[label](fb.input_ids, fb.positions, fb)
                        if cuda:
                            torch.cuda.synchronize()
                        if k >= warmup:
                            times[label].append((time.perf_counter() - t0) * 1e3)
            old_ms, new_ms = statistics.median(times["old"]), statistics.median(times["new"])
            rows.append({"prefix": prefix, "mode": mode, "tokens": int(cu[-1]), "rows": fb.num_rows,
                         "old_ms": old_ms, "new_ms": new_ms, "new_over_old": new_ms / old_ms,
                         "max_abs_diff": (outs["new"] - outs["old"]).abs().max().item()})
    return rows


def attention_ab(runner: Runner, *, batch: int, prefixes: list[int], suffix: int, repeats: int,
                 seed: int) -> list[dict]:
    """Per-run SDPA vs padded SDPA on one layer's attention inputs in the model's shapes,
    alternating; `plan_ms` is the padded layout's host planning, paid once per batch."""
    from models.attention.varlen import make_meta, sdpa_padded, sdpa_varlen

    cfg = runner.config
    h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for prefix in prefixes:
        ids, cu = synthetic_batch(batch, prefix, suffix, vocab=cfg.vocab_size, seed=seed)
        index = build_index(ids, positions_from_cu_seqlens(cu), cu)
        for mode in MODES:
            fb = build_forward_batch(ids, cu, None if mode == "off" else index, mode=mode)
            meta = fb.attn
            tq, tk = meta.host_cu_seqlens_q[-1], meta.host_cu_seqlens_k[-1]
            q = torch.randn(tq, h, d, generator=gen).to(runner.dtype)
            k = torch.randn(tk, hkv, d, generator=gen).to(runner.dtype)
            v = torch.randn(tk, hkv, d, generator=gen).to(runner.dtype)
            t0 = time.perf_counter()
            plan = make_meta(meta.host_cu_seqlens_q, meta.host_cu_seqlens_k, "cpu").padded
            plan_ms = (time.perf_counter() - t0) * 1e3
            times = {"sdpa": [], "sdpa-padded": []}
            fns = {"sdpa": sdpa_varlen, "sdpa-padded": sdpa_padded}
            with torch.inference_mode():
                meta.padded  # noqa: B018 - plan once, as the first layer does
                for k_ in range(repeats + 1):
                    for name in (("sdpa", "sdpa-padded") if k_ % 2 == 0 else ("sdpa-padded", "sdpa")):
                        t0 = time.perf_counter()
                        fns[name](q, k, v, meta, scale=d ** -0.5)
                        if k_:
                            times[name].append((time.perf_counter() - t0) * 1e3)
            a, b = statistics.median(times["sdpa"]), statistics.median(times["sdpa-padded"])
            rows.append({"prefix": prefix, "mode": mode, "seqs": len(meta.host_cu_seqlens_q) - 1,
                         "runs": len(meta.runs), "buckets": len(plan.buckets), "sdpa_ms": a,
                         "padded_ms": b, "padded_over_sdpa": b / a, "plan_ms": plan_ms})
    return rows
