"""Choosing the CPU's linear kernel once, at load, by timing the candidates on the model's shapes.

What varies: the weights' precision (``cpu_weights``: fp32, int8 or bf16, the operator's choice:
it changes the outputs) and, within it, the op (the choice made here: it does not change the
precision). Candidates, in order of preference:

    fp32: onednn-packed (models/linear/packed.py), F.linear
    int8: int8-dynamic, int8-rowwise            (models/linear/quant.py)
    bf16: bf16-packed, bf16-linear              (only on a CPU with avx512_bf16 or AMX, oneDNN
                                                 not capped below them; elsewhere the fp32 choice)

Invariant: a candidate runs only after it matched ``F.linear`` in float32 on the model's first
layer within its precision's tolerance (``SELF_TEST_TOL``); one that fails is rejected with its
reason. The others are timed on every distinct linear shape of the model at ``ROWS`` rows each,
at this process's thread count, alternating, best of ``REPEATS`` (about 0.2 s at the 0.6B shape on
two cores); the fastest by the geometric mean over the row counts (few rows and a batch count
alike) runs; the scores are kept per machine and shapes (models/measure_cache.py), so a later start
reads them instead. ``RADIXSERVE_CPU_LINEAR`` skips the timing: a candidate's name forces it, ``first``
takes the first candidate that passes its self-test (tests; reproducible runs).
Off the CPU, or in another dtype than float32, linears run ``F.linear`` in the model's dtype and
``cpu_weights`` has no effect (the report says so).
"""
from __future__ import annotations

import functools
import logging
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import measure_cache
from models.linear import packed as packed_linear
from models.linear.packed import Linear, clear_kernels, pack_linears, set_kernels, unpack_linears
from models.linear.quant import KERNELS, bf16_missing

log = logging.getLogger(__name__)

ENV = "RADIXSERVE_CPU_LINEAR"
CPU_WEIGHTS = ("fp32", "int8", "bf16")
CANDIDATES = {"fp32": ("onednn-packed", "F.linear"), "int8": ("int8-dynamic", "int8-rowwise"),
              "bf16": ("bf16-packed", "bf16-linear")}
# relative Frobenius error against F.linear in float32 on random rows: far above each format's
# rounding (fp32 ~1e-6, bf16 ~3e-3, int8 ~1e-2), far below a wrong result (~1)
SELF_TEST_TOL = {"fp32": 1e-4, "bf16": 0.02, "int8": 0.05}
ROWS = (4, 192)
REPEATS = 3
# oneDNN's ISA caps at or above avx512_bf16 (its ``ONEDNN_MAX_CPU_ISA`` values)
ONEDNN_BF16_ISAS = ("ALL", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
                    "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2")
PRUNE = 2.0  # after the first round, a candidate this many times slower than the best is not rerun


@dataclass(frozen=True)
class LinearChoice:
    """What runs: the weights' precision, the kernel, and the start-up log's words for why."""

    weights: str
    kernel: str
    report: str
    seconds: dict[str, float] = field(default_factory=dict)  # measured: kernel -> score
    failed: bool = False  # a candidate failed its self-test: a slower path may run (log a WARNING)


def bf16_refused() -> str | None:
    """Why bf16 weights would not run natively here (None: they would): the CPU lacks avx512_bf16
    and AMX, or ``ONEDNN_MAX_CPU_ISA`` (``DNNL_MAX_CPU_ISA``) keeps oneDNN below them, as on an
    AVX2 machine."""
    if missing := bf16_missing():
        return missing
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        cap = os.environ.get(name, "").strip().upper()
        if cap and cap not in ONEDNN_BF16_ISAS:
            return f"{name}={cap} keeps oneDNN off avx512_bf16 and AMX"
    return None


def check_cpu_weights(value: str) -> str:
    if value not in CPU_WEIGHTS:
        raise ValueError(f"cpu_weights must be one of {CPU_WEIGHTS}, got {value!r}")
    return value


def choose_linears(model: nn.Module, *, device: torch.device, dtype: torch.dtype, weights: str = "fp32",
                   packed_wanted: bool = True, keep_dense: bool = True, force: str | None = None,
                   timer: Callable[[], float] = time.perf_counter) -> LinearChoice:
    """Self-test, time and install the linear kernel of `weights` precision on every ``Linear``.

    force: a candidate's name, "first", or None (read ``RADIXSERVE_CPU_LINEAR``; unset: measure).
    timer: the clock the measurement reads (injected by tests)."""
    check_cpu_weights(weights)
    if device.type != "cpu" or dtype != torch.float32:
        why = "" if weights == "fp32" else f"; cpu_weights={weights} applies on a CPU in float32 only"
        return LinearChoice("fp32" if dtype == torch.float32 else str(dtype).replace("torch.", ""), "F.linear",
                            f"F.linear ({device.type} {str(dtype).replace('torch.', '')}{why})")
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    if not layers:
        return LinearChoice(weights, "F.linear", "F.linear (no linear layers)")
    force = force if force is not None else (os.environ.get(ENV) or None)
    candidates = list(CANDIDATES[weights])
    rejected: dict[str, str] = {}
    if weights == "fp32" and not packed_wanted:
        rejected["onednn-packed"] = "cpu_packed_weights off"
    if weights == "fp32" and not torch.backends.mkldnn.is_available():
        rejected["onednn-packed"] = "this torch build has no oneDNN (mkldnn)"
    if weights == "bf16" and (missing := bf16_refused()):
        # the fp32 weights with their own measured kernel: what this CPU runs best at full precision
        fp32 = choose_linears(model, device=device, dtype=dtype, packed_wanted=packed_wanted, keep_dense=keep_dense,
                              force=force if force in (None, "first", *CANDIDATES["fp32"]) else "first", timer=timer)
        return replace(fp32, report=fp32.report.replace(
            f"{fp32.kernel} (", f"{fp32.kernel} (cpu_weights=bf16 refused: {missing}; ", 1))
    if force not in (None, "first") and force not in candidates:
        raise ValueError(f"{ENV}={force!r} is not a {weights} linear kernel: use one of {candidates} or 'first'")
    passed: list[str] = []
    for name in candidates:
        if name in rejected or (force not in (None, "first") and name != force):
            continue
        try:
            _self_test(name, layers[0], SELF_TEST_TOL[weights])
            passed.append(name)
        except Exception as exc:  # noqa: BLE001 -- any failure rejects the candidate, with its reason
            rejected[name] = f"self-test failed: {type(exc).__name__}: {exc}"
    if not passed:
        if weights != "fp32" or force not in (None, "first"):
            raise RuntimeError(f"no {weights} linear kernel passed its self-test: {rejected}")
        passed.append("F.linear")  # the plain path needs no test
    threads = torch.get_num_threads()
    if force is not None or len(passed) == 1:
        name = passed[0]
        reasons = [f"{ENV}={force}"] if force is not None else []
        reasons += [f"{k}: {v}" for k, v in rejected.items()]
        choice = LinearChoice(weights, name, f"{name} ({'; '.join(reasons) or 'the only candidate'})")
    else:
        t0 = time.perf_counter()
        seconds, how = _measured(passed, _shapes(layers), timer)
        took = time.perf_counter() - t0
        ranked = sorted(seconds, key=seconds.__getitem__)
        name, runner_up = ranked[0], ranked[1]
        gain = seconds[runner_up] / seconds[name] if seconds[name] > 0 else math.inf
        others = "".join(f"; {k}: {v}" for k, v in rejected.items())
        choice = LinearChoice(weights, name, f"{name} ({gain:.2f}x {runner_up} on the model's shapes at "
                                             f"{threads} threads, {how} in {took:.2f} s{others})", seconds)
    failed = any(why.startswith("self-test failed") for why in rejected.values())
    return _install(model, replace(choice, failed=failed), keep_dense)


def _measured(names: list[str], shapes: list[Linear],
              timer: Callable[[], float]) -> tuple[dict[str, float], str]:
    """(`measure`'s scores of `names` on `shapes`, "measured" or "read from the measurement cache").

    The cache (models/measure_cache.py) serves only the real clock: an injected `timer` measures."""
    entry = measure_cache.key("cpu-linear", modules=("models.linear.packed", "models.linear.quant", "models.linear.select"),
                              dtype=torch.float32, kernels=names, rows=ROWS,
                              shapes=[(m.out_features, m.in_features, m.bias is not None) for m in shapes])
    if timer is time.perf_counter:
        cached = measure_cache.lookup(entry)
        if isinstance(cached, dict) and sorted(cached) == sorted(names) and all(
                isinstance(v, float) and v > 0 for v in cached.values()):
            return cached, "read from the measurement cache"
    seconds = measure({name: _prepare(name, shapes) for name in names}, timer=timer)
    if timer is time.perf_counter:
        measure_cache.store(entry, seconds)
    return seconds, "measured"


def _install(model: nn.Module, choice: LinearChoice, keep_dense: bool) -> LinearChoice:
    """Put `choice`'s kernel on every layer (fp32 packed: models.linear.packed.pack_linears)."""
    clear_kernels(model)
    unpack_linears(model)
    if choice.kernel == "onednn-packed":
        reason = pack_linears(model, device=torch.device("cpu"), dtype=torch.float32, keep_dense=keep_dense)
        if reason is not None:
            return LinearChoice(choice.weights, "F.linear", f"F.linear ({reason})", failed=True)
    elif choice.kernel in KERNELS:
        set_kernels(model, choice.kernel, keep_dense=keep_dense)
    return choice


def _shapes(layers: list[Linear]) -> list[Linear]:
    """The first layer of each distinct (out, in, bias) shape: what the model's GEMMs look like."""
    seen: dict[tuple[int, int, bool], Linear] = {}
    for m in layers:
        seen.setdefault((m.out_features, m.in_features, m.bias is not None), m)
    return list(seen.values())


def _prepare(name: str, layers: list[Linear]) -> list[tuple[Callable[[Tensor], Tensor], int]]:
    """[(op [M, in] -> [M, out], in)] for each of `layers` with `name`'s weight format."""
    out: list[tuple[Callable[[Tensor], Tensor], int]] = []
    for m in layers:
        w, b = m.dense_weight().detach(), None if m.bias is None else m.bias.detach()
        op: Callable[[Tensor], Tensor]
        if name == "F.linear":
            op = functools.partial(F.linear, weight=w, bias=b)
        elif name == "onednn-packed":
            op = functools.partial(_packed, packed=packed_linear._reorder(w), bias=b)
        else:
            op = KERNELS[name](w, b)
        out.append((op, m.in_features))
    return out


def _packed(x: Tensor, *, packed: Tensor, bias: Tensor | None) -> Tensor:
    return packed_linear._packed_linear(x, packed, bias)


def _self_test(name: str, layer: Linear, tol: float) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = layer.dense_weight().detach()
    (op, k), = _prepare(name, [layer])
    x = torch.randn(5, k, generator=gen)
    with torch.inference_mode():
        want = F.linear(x, weight, layer.bias)
        got = op(x)
    if got.shape != want.shape or got.dtype != torch.float32:
        raise RuntimeError(f"{tuple(got.shape)} {got.dtype} != {tuple(want.shape)} float32")
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    if not err <= tol:  # NOTE: also catches NaN
        raise RuntimeError(f"relative error {err:.3g} against F.linear (tolerance {tol:g})")


def measure(ops: dict[str, list[tuple[Callable[[Tensor], Tensor], int]]], *,
            timer: Callable[[], float] = time.perf_counter, rows: tuple[int, ...] = ROWS,
            repeats: int = REPEATS) -> dict[str, float]:
    """{kernel: geometric mean over `rows` of its best time over all the shapes} (seconds).

    One untimed call of each first (first-call setup), then `repeats` rounds alternating the
    kernels, so load on a shared machine hits them alike; a kernel ``PRUNE`` times slower than
    the best after the first round keeps its first time (the choice does not hinge on it)."""
    gen = torch.Generator().manual_seed(0)
    inputs = {(m, k): torch.randn(m, k, generator=gen) for m in rows for _, k in next(iter(ops.values()))}
    best = {(name, m): math.inf for name in ops for m in rows}
    def score(name: str) -> float:
        return math.exp(sum(math.log(max(best[(name, m)], 1e-12)) for m in rows) / len(rows))

    timed = list(ops)
    with torch.inference_mode():
        for name, layer_ops in ops.items():
            for op, k in layer_ops:
                op(inputs[(rows[0], k)])
        for _ in range(repeats):
            for m in rows:
                for name in timed:
                    t0 = timer()
                    for op, k in ops[name]:
                        op(inputs[(m, k)])
                    best[(name, m)] = min(best[(name, m)], timer() - t0)
            fastest = min(score(name) for name in timed)
            timed = [name for name in timed if score(name) <= PRUNE * fastest]
    return {name: score(name) for name in ops}
