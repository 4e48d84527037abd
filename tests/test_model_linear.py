"""CPU linears on oneDNN-packed weights: the same outputs as F.linear, used only for inference,
and a failing self-test leaves the plain path with a logged reason."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import models.linear.packed as linear
from models.linear.packed import Linear, pack_linears, unpack_linears
from models.runner import load_runner
from tests.test_model_hotpath import OpLog


def _layers(bias: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(64, 96, bias=bias), torch.nn.Linear(96, 8), Linear(96, 40, bias=bias))
    return model


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 6, 37])
def test_packed_equals_f_linear(bias, rows):
    model = _layers(bias)
    assert pack_linears(model, device=torch.device("cpu"), dtype=torch.float32) is None
    first, last = model[0], model[2]
    assert first.packed is not None and last.packed is not None
    x = torch.randn(rows, 2 * 64)[:, ::2]  # strided input rows
    with torch.inference_mode(), OpLog() as log:
        got = first(x)
    assert log.ops["mkldnn._linear_pointwise"] == 1 and log.ops["aten.linear"] == 0
    want = (x.double() @ first.weight.double().T + (first.bias.double() if bias else 0))  # float64
    assert got.shape == (rows, 96)
    assert (got.double() - want).abs().max().item() < 1e-4


def test_autograd_uses_the_dense_weight():
    model = _layers(True)
    pack_linears(model, device=torch.device("cpu"), dtype=torch.float32)
    x = torch.randn(3, 64)
    with OpLog() as log:
        model[0](x).sum().backward()
    assert log.ops["aten.linear"] + log.ops["aten.addmm"] >= 1 and log.ops["mkldnn._linear_pointwise"] == 0
    assert model[0].weight.grad is not None and torch.allclose(model[0].weight.grad, x.sum(0).expand(96, -1))


def test_not_packed_off_cpu_fp32_or_after_a_failed_self_test(monkeypatch):
    model = _layers(False)
    assert "bfloat16" in pack_linears(model, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert "cuda" in pack_linears(model, device=torch.device("cuda"), dtype=torch.float32)
    monkeypatch.setattr(linear, "_packed_linear", lambda x, p, b: F.linear(x, torch.zeros(96, 64)))
    reason = pack_linears(model, device=torch.device("cpu"), dtype=torch.float32)
    assert reason.startswith("oneDNN self-test failed") and "max error" in reason
    assert all(getattr(m, "packed", None) is None for m in model)


def test_runner_logs_which_path_runs(tiny_embedding_dir, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="models.runner")
    runner = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", prefix_cache_size=0)
    assert runner.report.linear == "onednn-packed"
    assert "linear layers: fp32 weights, onednn-packed" in caplog.text
    off = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", prefix_cache_size=0,
                      cpu_packed_weights=False)
    assert off.report.linear == "F.linear"
    # The same weights, packed or not, give the same embeddings.
    ids = torch.tensor([5, 6, 7, 8, 9, 10], dtype=torch.int32)
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    a, b = runner.run(runner.prepare(ids, cu)), off.run(off.prepare(ids, cu))
    assert (a - b).abs().max().item() < 1e-4
    unpack_linears(runner.model)
    assert runner.run(runner.prepare(ids, cu)).sub(b).abs().max().item() < 1e-6

    caplog.clear()
    monkeypatch.setattr(linear, "_reorder", lambda w: (_ for _ in ()).throw(RuntimeError("no kernel")))
    broken = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", prefix_cache_size=0)
    assert broken.report.linear == "F.linear"
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "linear layers" in r.message]
    assert warned and "RuntimeError: no kernel" in warned[0].message


def test_dropping_the_dense_copy_keeps_every_path_exact(tiny_embedding_dir):
    kept = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", prefix_cache_size=0)
    lean = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", prefix_cache_size=0,
                       keep_dense_weights=False)
    linears = [m for m in lean.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.numel() == 0 and m.packed is not None for m in linears)
    originals = {n: m.weight.detach().clone() for n, m in kept.model.named_modules() if isinstance(m, Linear)}
    for name, m in lean.model.named_modules():
        if isinstance(m, Linear):  # rebuilt from the packed copy: the very same numbers
            assert torch.equal(m.dense_weight(), originals[name])
    ids = torch.tensor([5, 6, 7, 8, 9, 10], dtype=torch.int32)
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    want = kept.run(kept.prepare(ids, cu))
    assert torch.equal(lean.run(lean.prepare(ids, cu)), want)  # same packed op, same weights
    x = torch.randn(3, linears[0].in_features)
    with torch.enable_grad():  # the F.linear path, on the rebuilt weight
        got = linears[0](x)
    assert (got - F.linear(x, originals[next(n for n, m in lean.model.named_modules() if m is linears[0])],
                           linears[0].bias)).abs().max().item() == 0.0
    assert pack_linears(lean.model, device=torch.device("cpu"), dtype=torch.float32) is None  # again: a no-op
    unpack_linears(lean.model)
    assert all(m.packed is None and not m.dense_dropped and m.weight.numel() > 0 for m in linears)
    assert (lean.run(lean.prepare(ids, cu)) - want).abs().max().item() < 1e-4
