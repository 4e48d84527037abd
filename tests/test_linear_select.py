"""The CPU linear kernel chosen at load: the selection logic on an injected clock (no real timing
in any assert), forcing and rejection, and each kernel against an independent float64 product."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import models.linear.select as select
from models.linear.packed import Linear
from models.linear.quant import KERNELS, INT8_MAX, Kernel, bf16_missing

CPU = torch.device("cpu")


def _model(bias: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Linear(64, 96, bias=bias), Linear(96, 64, bias=bias), Linear(64, 96, bias=bias))


class Clock:
    """A clock that advances only when an op runs: by cost[kernel] per input row."""

    def __init__(self, cost: dict[str, float]):
        self.now, self.cost = 0.0, cost

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clocked(monkeypatch):
    """Install a Clock whose ops charge their kernel's cost; returns a factory for it."""
    def make(cost: dict[str, float]) -> Clock:
        clock = Clock(cost)
        real = select._prepare

        def prepare(name, layers):
            def charged(op):
                def run(x):
                    clock.now += clock.cost[name] * x.shape[0]
                    return op(x)
                return run
            return [(charged(op), k) for op, k in real(name, layers)]

        monkeypatch.setattr(select, "_prepare", prepare)
        return clock
    monkeypatch.delenv(select.ENV, raising=False)
    return make


@pytest.mark.parametrize("cost, want", [({"onednn-packed": 1.0, "F.linear": 3.0}, "onednn-packed"),
                                        ({"onednn-packed": 2.0, "F.linear": 1.0}, "F.linear")])
def test_the_faster_fp32_kernel_is_chosen_and_installed(clocked, cost, want):
    model = _model()
    choice = select.choose_linears(model, device=CPU, dtype=torch.float32, timer=clocked(cost))
    slow, fast = sorted(cost.values(), reverse=True)
    other = next(k for k in cost if k != want)
    assert choice.kernel == want and choice.weights == "fp32"
    assert f"{slow / fast:.2f}x {other}" in choice.report
    assert choice.seconds[want] < choice.seconds[other]
    assert all((m.packed is not None) == (want == "onednn-packed") and m.kernel is None for m in model)


def test_int8_kernels_are_compared_on_the_clock(clocked):
    model = _model()
    choice = select.choose_linears(model, device=CPU, dtype=torch.float32, weights="int8",
                                   timer=clocked({"int8-dynamic": 5.0, "int8-rowwise": 1.0}))
    assert choice.kernel == "int8-rowwise" and "5.00x int8-dynamic" in choice.report
    assert all(m.kernel is not None and m.kernel.name == "int8-rowwise" and m.packed is None for m in model)


def test_the_geometric_mean_weighs_few_rows_and_many_alike():
    now = [0.0]
    # a: 1 per call at 4 rows, 100 at 192; b: 10 and 20: b wins (sqrt(200) < sqrt(100))... a: sqrt(100)=10
    cost = {"a": {4: 1.0, 192: 100.0}, "b": {4: 10.0, 192: 20.0}}

    def op(name):
        def run(x):
            now[0] += cost[name][x.shape[0]]
        return run

    ops = {name: [(op(name), 8)] for name in cost}
    seconds = select.measure(ops, timer=lambda: now[0], rows=(4, 192), repeats=2)
    assert seconds["a"] == pytest.approx(10.0) and seconds["b"] == pytest.approx(200 ** 0.5)


def test_a_far_slower_kernel_is_timed_once():
    now, calls = [0.0], {"fast": 0, "slow": 0}

    def op(name, cost):
        def run(x):
            calls[name] += 1
            now[0] += cost
        return run

    ops = {"fast": [(op("fast", 1.0), 8)], "slow": [(op("slow", select.PRUNE * 1.5), 8)]}
    seconds = select.measure(ops, timer=lambda: now[0], rows=(4,), repeats=3)
    assert calls == {"fast": 1 + 3, "slow": 1 + 1}  # the untimed first call, then the rounds
    assert seconds["slow"] == pytest.approx(select.PRUNE * 1.5) and seconds["fast"] == pytest.approx(1.0)


def test_forcing_skips_the_measurement(monkeypatch):
    def no_clock() -> float:
        raise AssertionError("measured although forced")

    monkeypatch.setenv(select.ENV, "F.linear")
    model = _model()
    choice = select.choose_linears(model, device=CPU, dtype=torch.float32, timer=no_clock)
    assert choice.kernel == "F.linear" and select.ENV in choice.report
    assert all(m.packed is None and m.kernel is None for m in model)
    monkeypatch.setenv(select.ENV, "first")
    assert select.choose_linears(model, device=CPU, dtype=torch.float32, weights="int8",
                                 timer=no_clock).kernel == "int8-dynamic"
    with pytest.raises(ValueError, match="not a int8 linear kernel"):
        select.choose_linears(model, device=CPU, dtype=torch.float32, weights="int8", force="onednn-packed")
    with pytest.raises(ValueError, match="cpu_weights"):
        select.choose_linears(model, device=CPU, dtype=torch.float32, weights="int4")


def test_packed_off_and_other_dtypes_run_f_linear(monkeypatch):
    monkeypatch.delenv(select.ENV, raising=False)
    model = _model()
    off = select.choose_linears(model, device=CPU, dtype=torch.float32, packed_wanted=False)
    assert off.kernel == "F.linear" and "cpu_packed_weights off" in off.report
    other = select.choose_linears(model.to(torch.float64), device=CPU, dtype=torch.float64, weights="int8")
    assert other.kernel == "F.linear" and "applies on a CPU in float32 only" in other.report
    assert all(m.packed is None and m.kernel is None for m in model)


def test_a_kernel_failing_its_self_test_is_rejected(clocked, monkeypatch):
    class Wrong(Kernel):
        name = "int8-dynamic"

        def __init__(self, weight, bias):
            self.out = weight.shape[0]

        def __call__(self, x):
            return torch.ones(x.shape[0], self.out)

    monkeypatch.setitem(KERNELS, "int8-dynamic", Wrong)
    model = _model()
    choice = select.choose_linears(model, device=CPU, dtype=torch.float32, weights="int8",
                                   timer=clocked({"int8-dynamic": 0.1, "int8-rowwise": 1.0}))
    assert choice.kernel == "int8-rowwise" and "int8-dynamic: self-test failed" in choice.report
    monkeypatch.setitem(KERNELS, "int8-rowwise", Wrong)
    with pytest.raises(RuntimeError, match="no int8 linear kernel passed"):
        select.choose_linears(model, device=CPU, dtype=torch.float32, weights="int8", force="first")


def _reference(name: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float64 product of what `name` computes, written from the formats, not from the kernels."""
    x, w, b = x.double(), w.double(), b.double()
    if name.startswith("bf16"):
        return x.bfloat16().double() @ w.bfloat16().double().T + b.bfloat16().double()
    ws = w.abs().amax(1) / INT8_MAX
    wq = torch.round(w / ws[:, None]) * ws[:, None]  # the dequantized weight
    if name == "int8-rowwise":
        xs = x.abs().amax(1, keepdim=True) / INT8_MAX
        x = torch.round(x / xs) * xs
    return x @ wq.T + b


# relative to the output's scale: the output's own rounding (bf16 8 bits) or, for int8-dynamic,
# its uint8 input quantization, which the reference leaves out; exact kernels sit near 1e-6
TOL = {"int8-rowwise": 1e-5, "int8-dynamic": 0.03, "bf16-packed": 0.01, "bf16-linear": 0.01}


@pytest.mark.parametrize("name", sorted(KERNELS))
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_each_kernel_computes_its_format(name, rows):
    if name.startswith("bf16") and bf16_missing():
        pytest.skip(bf16_missing() or "")
    torch.manual_seed(rows)
    w, b = torch.randn(48, 80) * 0.05, torch.randn(48)
    x = torch.randn(rows, 2 * 80)[:, ::2]  # strided rows: the Linear makes them contiguous
    layer = Linear(80, 48)
    layer.weight.data, layer.bias.data = w.clone(), b.clone()
    layer.kernel = KERNELS[name](w, b)
    with torch.inference_mode():
        got = layer(x)
    want = _reference(name, x, w, b)
    assert got.dtype == torch.float32 and got.shape == (rows, 48)
    err = (got.double() - want).abs().max().item() / want.abs().max().item()
    assert err <= TOL[name], err
    # the autograd path runs the kept dense weight, the kernel's dense() its own format
    assert torch.equal(layer.dense_weight(), w)
    assert (layer.kernel.dense().double() - w.double()).abs().max().item() <= 0.01 * w.abs().max().item()


@pytest.mark.parametrize("cost, want", [({"onednn-packed": 1.0, "F.linear": 3.0}, "onednn-packed"),
                                        ({"onednn-packed": 2.0, "F.linear": 1.0}, "F.linear")])
def test_refused_bf16_weights_run_the_measured_fp32_kernel(clocked, monkeypatch, cost, want):
    monkeypatch.setattr(select, "bf16_missing", lambda: "no avx512_bf16 here")
    model = _model()
    choice = select.choose_linears(model, device=CPU, dtype=torch.float32, weights="bf16", timer=clocked(cost))
    assert choice.weights == "fp32" and choice.kernel == want
    assert "cpu_weights=bf16 refused: no avx512_bf16 here" in choice.report
    assert all((m.packed is not None) == (want == "onednn-packed") and m.kernel is None for m in model)


@pytest.mark.parametrize("name", ["ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"])
def test_a_onednn_cap_below_avx512_bf16_refuses_bf16_weights(monkeypatch, name):
    monkeypatch.setattr(select, "bf16_missing", lambda: None)
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(var, raising=False)
    assert select.bf16_refused() is None
    monkeypatch.setenv(name, "avx512_core_amx")
    assert select.bf16_refused() is None
    monkeypatch.setenv(name, "AVX2")
    assert f"{name}=AVX2" in (select.bf16_refused() or "")
    monkeypatch.setenv(select.ENV, "bf16-packed")  # a forced bf16 kernel that cannot run: the first fp32 one
    choice = select.choose_linears(_model(), device=CPU, dtype=torch.float32, weights="bf16")
    assert choice.weights == "fp32" and choice.kernel == select.CANDIDATES["fp32"][0] and "refused" in choice.report
