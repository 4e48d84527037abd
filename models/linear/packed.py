"""Linear layers with weights reordered once at load for oneDNN on the CPU.

Why: a forward over a few rows (one query, one cached rerank pair) is a stack of GEMMs with a
small M. MKL's sgemm behind ``F.linear`` repacks the whole weight on every call, which dominates
a forward over a few rows. oneDNN's linear takes a weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``) and skips that repacking: the fewer the rows, the
larger the gain, and at a few hundred rows the two are even (``python -m benchmarks.bench_linear``;
docs/decisions.md, "oneDNN packed linears on the CPU"); the same arithmetic up to summation order.

Contract:
- ``Linear`` is ``nn.Linear``; after ``pack_linears`` it runs the reordered weight under
  ``torch.inference_mode``/``no_grad`` for 2-D fp32 CPU inputs, and ``F.linear`` otherwise.
  With ``keep_dense=True`` (the library default) the dense ``weight`` stays too: gradients reach
  it, at the cost of a second copy of every packed weight. The server packs with
  ``keep_dense=False``: ``weight`` becomes an empty placeholder, so serving holds one copy, and
  the rare other path (autograd recording, another shape or dtype) runs ``F.linear`` on the
  weight rebuilt from the packed copy (exact: a reorder is a permutation). ``--cpu-packed-weights
  false`` at the server keeps plain ``F.linear`` (docs/operations.md).
- A ``Linear`` given a reduced-precision ``kernel`` (models/linear/quant.py: int8 or bf16
  weights, chosen and measured at load by models/linear/select.py) runs it instead, under the
  same conditions; once the dense weight is dropped, ``dense_weight`` is the one the kernel
  computes with (int8: dequantized).
- ``pack_linears`` runs only on the CPU in float32, and only after a self-test of the op on the
  model's first layer against ``F.linear``; any error or mismatch leaves every layer on
  ``F.linear`` and returns the reason (the runner logs it at WARNING), never a silent slow path.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.linear.quant import KERNELS, Kernel

SELF_TEST_ROWS = 5
SELF_TEST_TOL = 1e-4  # relative to the output's scale; fp32 summation order differs by ~1e-6


class Linear(nn.Linear):
    """nn.Linear that uses a oneDNN-reordered weight for CPU fp32 inference once packed."""

    packed: Tensor | None = None
    kernel: Kernel | None = None  # a reduced-precision weight and its op (models.linear.quant)

    @property
    def dense_dropped(self) -> bool:
        """The weight is an empty placeholder: the packed copy (or the kernel's) is the only one."""
        return (self.packed is not None or self.kernel is not None) and self.weight.numel() == 0

    def forward(self, x: Tensor) -> Tensor:
        # NOTE: the parameters read from ``_parameters``, not as ``self.weight``: the same entries
        # (``nn.Module.__setattr__`` keeps them), without ``Module.__getattr__``'s Python call,
        # paid by every linear of every layer of every forward.
        packed, kernel = self.packed, self.kernel
        params: dict[str, Any] = self._parameters
        if packed is None and kernel is None:
            return F.linear(x, params["weight"], params["bias"])
        if torch.is_grad_enabled() or x.dim() != 2 or x.shape[0] == 0 or x.dtype != torch.float32 \
                or not x.is_cpu:
            return F.linear(x, self.dense_weight(), params["bias"])
        if kernel is not None:
            return kernel(x.contiguous())
        assert packed is not None
        return _packed_linear(x.contiguous(), packed, params["bias"])

    def dense_weight(self) -> Tensor:
        """[out, in]: the weight itself, or rebuilt from the packed (or kernel's) copy once dropped."""
        if self.dense_dropped and self.kernel is not None:
            return self.kernel.dense()  # NOTE: int8: the dequantized weight the kernel computes with
        if self.dense_dropped and self.packed is not None:  # dropped only after packing
            return self.packed.to_dense()
        return self.weight


def _packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _reorder(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def pack_linears(model: nn.Module, *, device: torch.device, dtype: torch.dtype,
                 keep_dense: bool = True) -> str | None:
    """Reorder every ``Linear`` weight of `model` for oneDNN; None when done, else why not.

    keep_dense=False frees each dense weight once its packed copy exists (module docstring)."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    if device.type != "cpu":
        return f"device is {device.type}"
    if dtype != torch.float32:
        return f"dtype is {str(dtype).replace('torch.', '')} (packed only in float32)"
    if not layers:
        return "no linear layers"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    try:
        _self_test(layers[0])
        for m in layers:  # one layer at a time: without the dense copies the peak is one layer more
            if m.packed is None:
                m.packed = _reorder(m.weight)
            if not keep_dense and not m.dense_dropped:
                # NOTE: an empty placeholder keeps nn.Linear's attribute; the dense memory goes now
                m.weight = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=False)
    except Exception as exc:  # noqa: BLE001 -- any failure means the plain path, with its reason
        unpack_linears(model)  # every layer back to F.linear, dropped weights rebuilt
        return f"oneDNN self-test failed: {type(exc).__name__}: {exc}"
    return None


def unpack_linears(model: nn.Module) -> None:
    """Back to ``F.linear`` everywhere (drops the reordered copies, restoring dropped weights)."""
    for m in model.modules():
        if isinstance(m, Linear) and m.packed is not None:
            if m.dense_dropped:
                m.weight = nn.Parameter(m.packed.to_dense(), requires_grad=False)
            m.packed = None


def set_kernels(model: nn.Module, name: str, *, keep_dense: bool = True) -> None:
    """Give every ``Linear`` of `model` a `name` kernel (models.linear.quant.KERNELS) built from
    its float32 weight, one layer at a time; keep_dense=False frees each dense weight after."""
    make = KERNELS[name]
    for m in model.modules():
        if isinstance(m, Linear):
            weight = m.dense_weight()
            m.packed = None
            m.kernel = make(weight, m.bias)
            if not keep_dense and m.weight.numel():
                m.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device),
                                        requires_grad=False)


def clear_kernels(model: nn.Module) -> None:
    """Drop every reduced-precision kernel; a dropped dense weight comes back dequantized."""
    for m in model.modules():
        if isinstance(m, Linear) and m.kernel is not None:
            if m.weight.numel() == 0:
                m.weight = nn.Parameter(m.kernel.dense(), requires_grad=False)
            m.kernel = None


def _self_test(layer: Linear) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = layer.dense_weight()
    x = torch.randn(SELF_TEST_ROWS, layer.in_features, generator=gen, dtype=weight.dtype)
    with torch.inference_mode():
        want = F.linear(x, weight, layer.bias)
        got = _packed_linear(x, _reorder(weight), layer.bias)
    if got.shape != want.shape:
        raise RuntimeError(f"shape {tuple(got.shape)} != {tuple(want.shape)}")
    err = (got - want).abs().max().item()
    scale = want.abs().max().item() or 1.0
    if not err <= SELF_TEST_TOL * scale:  # NOTE: also catches NaN
        raise RuntimeError(f"max error {err:.3g} against F.linear (scale {scale:.3g})")
