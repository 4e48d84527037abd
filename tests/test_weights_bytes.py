"""/info's `memory.weights_bytes` is the weights as served: int8 or bf16 linear weights count at
their own size, not the float32 checkpoint's.

The expected figure is recounted here from the served tensors themselves: every parameter and
buffer, plus each linear layer's copy read back through its own format (fbgemm's packed int8
unpacked with its per-row scales, oneDNN's reordered weights turned dense again).
"""
from __future__ import annotations

import pytest
import torch

import fixtures
from models.linear.packed import Linear
from models.linear.quant import bf16_missing
from models.runner import load_runner


def _served_bytes(model) -> tuple[int, int]:
    """(bytes of what the model serves with, bytes of the same weights in float32)."""
    total = fp32 = 0
    for t in (*model.parameters(), *model.buffers()):
        total += t.nbytes
        fp32 += t.nbytes
    for m in model.modules():
        if not isinstance(m, Linear):
            continue
        assert m.weight.numel() == 0  # the server's setting: the dense float32 weight is freed
        fp32 += m.out_features * m.in_features * 4
        own_bias = lambda b: b is not None and (m.bias is None or b.data_ptr() != m.bias.data_ptr())  # noqa: E731
        k = m.kernel
        if k is None:  # float32, reordered for oneDNN
            total += m.packed.to_dense().nbytes
        elif k.name == "int8-dynamic":
            qweight, bias = torch.ops.quantized.linear_unpack(k.packed)
            total += qweight.int_repr().nbytes + qweight.q_per_channel_scales().float().nbytes
            total += bias.float().nbytes if bias is not None else 0
        elif k.name == "int8-rowwise":
            total += k.qweight.nbytes + k.scales.nbytes + (k.bias.nbytes if own_bias(k.bias) else 0)
        elif k.name == "bf16-packed":
            total += k.packed.to_dense().nbytes + (k.bias.nbytes if own_bias(k.bias) else 0)
        else:
            assert k.name == "bf16-linear"
            total += k.weight.nbytes + (k.bias.nbytes if own_bias(k.bias) else 0)
    return total, fp32


CASES = [("fp32", "onednn-packed"), ("int8", "int8-dynamic"), ("int8", "int8-rowwise"),
         ("bf16", "bf16-packed"), ("bf16", "bf16-linear")]


@pytest.mark.parametrize("weights,kernel", CASES)
def test_weights_bytes_counts_the_weights_as_served(fixture_root, monkeypatch, weights, kernel):
    if weights == "bf16" and bf16_missing():
        pytest.skip(bf16_missing())
    monkeypatch.setenv("RADIXSERVE_CPU_LINEAR", kernel)
    path = fixtures.cached("tiny-embedding", root=fixture_root)
    runner = load_runner(str(path), device="cpu", dtype="float32", prefix_cache_size=0,
                         cpu_weights=weights, keep_dense_weights=False)
    assert runner.report.linear == kernel
    served, fp32 = _served_bytes(runner.model)
    assert runner.report.memory["weights_bytes"] == served
    if weights == "fp32":
        assert served == fp32
    else:  # the linear weights at 1 or 2 bytes a value: well below the float32 model
        assert served < fp32
