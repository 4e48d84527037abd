"""Reduced-precision linear kernels for the CPU: int8 and bf16 weights behind ``Linear.kernel``.

Each kernel holds one layer's weight in its own format, prepared once at load, and maps a 2-D
float32 input [M, in] to a float32 output [M, out]; the residual stream, norms and attention stay
in float32. ``dense()`` rebuilds the [out, in] float32 weight the kernel computes with (the
dequantized one for int8) for the paths a kernel does not serve (autograd, other ranks).

- ``int8-dynamic``: torch's dynamic int8 linear (``quantized.linear_dynamic``, fbgemm/x86
  engine): int8 weights, one scale per output row (symmetric); each call quantizes its input
  to uint8 with one scale for the whole [M, in] matrix. Without VNNI the input keeps 7 bits
  (``reduce_range``): AVX2's 16-bit pairwise sums would otherwise saturate.
- ``int8-rowwise``: the same int8 weights; each input row gets its own symmetric int8 scale
  (what llama.cpp's Q8_0 does per 32 values), then ``aten._int_mm`` (int8 x int8 -> int32).
  A row's result does not depend on the other rows of its batch.
- ``bf16-packed``: bf16 weights reordered once for oneDNN (avx512_bf16/AMX where the CPU has
  them), bf16 inputs, float32 out.
- ``bf16-linear``: plain ``F.linear`` on bf16 weights and inputs.
Which of a precision's kernels runs is measured at load (models/linear/select.py).
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

INT8_MAX = 127.0


class Kernel:
    """One layer's weight prepared for one CPU op; ``__call__``: [M, in] fp32 -> [M, out] fp32."""

    name = ""

    def __call__(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def dense(self) -> Tensor:
        """[out, in] float32: the weight this kernel computes with."""
        raise NotImplementedError

    def tensors(self) -> list[Tensor]:
        """The plain tensors this kernel holds (its weight, scales, bias): /info's weights figure."""
        return []

    def opaque_bytes(self) -> int:
        """Bytes it holds in a backend's own format (oneDNN-reordered or fbgemm-packed weights),
        counted as their values: 1 per int8, 2 per bf16, 4 per float32 scale or bias."""
        return 0


def _row_scales(w: Tensor) -> Tensor:
    """[out] float32: symmetric per-row scales for int8 (an all-zero row gets scale 1)."""
    amax = w.detach().abs().amax(dim=1).float()
    return torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))


def _quantize_rows(w: Tensor, scales: Tensor) -> Tensor:
    return torch.round(w.detach().float() / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)


def _engine() -> str:
    engines = torch.backends.quantized.supported_engines
    for name in ("x86", "fbgemm"):
        if name in engines:
            return name
    raise RuntimeError(f"this torch has no x86 quantized engine (has {engines})")


class Int8Dynamic(Kernel):
    """int8 weights per output row; the input quantized per call (one scale per matrix)."""

    name = "int8-dynamic"

    def __init__(self, weight: Tensor, bias: Tensor | None):
        scales = _row_scales(weight)
        engine, previous = _engine(), torch.backends.quantized.engine
        torch.backends.quantized.engine = engine
        try:
            with warnings.catch_warnings():  # NOTE: torch marks quantized tensors deprecated
                warnings.simplefilter("ignore")
                qweight = torch.quantize_per_channel(
                    weight.detach().float(), scales.double(),
                    torch.zeros(weight.shape[0], dtype=torch.long), 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(
                qweight, None if bias is None else bias.detach().float())
        finally:
            torch.backends.quantized.engine = previous
        # 16-bit pairwise sums saturate on uint8 x int8 without VNNI: keep 7 bits there
        self.reduce_range = not torch.cpu._is_vnni_supported()
        out, inner = weight.shape
        # int8 values, a float32 scale per row and the packed float32 bias
        self._bytes = out * inner + 4 * out + (0 if bias is None else 4 * out)

    def __call__(self, x: Tensor) -> Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, self.reduce_range)

    def dense(self) -> Tensor:
        qweight, _ = torch.ops.quantized.linear_unpack(self.packed)
        return qweight.dequantize()

    def opaque_bytes(self) -> int:
        return self._bytes


class Int8Rowwise(Kernel):
    """int8 weights per output row; each input row quantized to int8 with its own scale."""

    name = "int8-rowwise"

    def __init__(self, weight: Tensor, bias: Tensor | None):
        self.scales = _row_scales(weight)  # [out]
        self.qweight = _quantize_rows(weight, self.scales)  # [out, in] int8
        self.bias = None if bias is None else bias.detach().float()

    def __call__(self, x: Tensor) -> Tensor:
        amax = x.abs().amax(dim=1, keepdim=True)  # [M, 1]
        xs = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
        xq = torch.round(x / xs).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)  # [M, in]
        y = torch._int_mm(xq, self.qweight.t()).float()  # [M, out] int32 sums -> fp32
        y.mul_(xs).mul_(self.scales)
        return y if self.bias is None else y.add_(self.bias)

    def dense(self) -> Tensor:
        return self.qweight.float() * self.scales[:, None]

    def tensors(self) -> list[Tensor]:
        return [self.qweight, self.scales] + ([] if self.bias is None else [self.bias])


class Bf16Packed(Kernel):
    """bf16 weights reordered once for oneDNN; bf16 inputs, float32 outputs."""

    name = "bf16-packed"

    def __init__(self, weight: Tensor, bias: Tensor | None):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().bfloat16(), None)
        self.bias = None if bias is None else bias.detach().bfloat16()

    def __call__(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.bfloat16(), self.packed, self.bias, "none", [], "").float()

    def dense(self) -> Tensor:
        return self.packed.to_dense().float()

    def tensors(self) -> list[Tensor]:
        return [] if self.bias is None else [self.bias]

    def opaque_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


class Bf16Linear(Kernel):
    """bf16 weights through plain ``F.linear``; bf16 inputs, float32 outputs."""

    name = "bf16-linear"

    def __init__(self, weight: Tensor, bias: Tensor | None):
        self.weight = weight.detach().bfloat16().contiguous()
        self.bias = None if bias is None else bias.detach().bfloat16()

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x.bfloat16(), self.weight, self.bias).float()

    def dense(self) -> Tensor:
        return self.weight.float()

    def tensors(self) -> list[Tensor]:
        return [self.weight] + ([] if self.bias is None else [self.bias])


KERNELS: dict[str, Callable[[Tensor, Tensor | None], Kernel]] = {
    k.name: k for k in (Int8Dynamic, Int8Rowwise, Bf16Packed, Bf16Linear)}


def bf16_missing() -> str | None:
    """Why this CPU cannot run bf16 GEMMs natively (None: it can)."""
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return None
    return "this CPU has neither avx512_bf16 nor AMX"
