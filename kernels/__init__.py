"""Row gather for compact <-> full layouts, with pure-torch ``ref_`` twins.

The forward moves rows between the compact (N') and full (N) layouts with gathers along dim 0.
``get_gather_rows(device)`` picks the implementation once, when a model is built; the ``ref_``
twins are the CPU path, the fallback and the test oracle. Gradients flow through every variant.

Which implementation runs on CUDA is data-driven, set by ``RADIXSERVE_GATHER_IMPL``:
- ``auto`` (default): the custom kernel (kernels/gather.cu) for the K/V pair variant and for
  strided sources (the K/V slices of a fused QKV projection, which index_select would first
  copy to contiguous); torch's index_select for packed single tensors.
- ``cuda``: the custom kernel wherever its checks pass; ``torch``: index_select everywhere.
NOTE: the ``auto`` split is a prior, not yet a measurement. The issue asks to time torch's
index_select, advanced indexing and torch.gather against a device-to-device copy on the H100
and keep the custom kernel only where it wins: ``python -m loadtest.bench_kernels`` (or
``python -m loadtest.gpu_check``) prints those figures; update ``auto`` to match them.

``RADIXSERVE_DISABLE_KERNELS=1`` forces the ref twins and never builds anything. Importing this
package never builds the extension: the build happens on the first ``get_*``/``describe`` call
for a CUDA device.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

GatherFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
GatherPairFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]

GATHER_IMPLS = ("auto", "cuda", "torch")


def ref_gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """src [N, ...], index [M] -> [M, ...] (autograd through index_select)."""
    return src.index_select(0, index)


def ref_gather_rows_pair(k: torch.Tensor, v: torch.Tensor, index: torch.Tensor):
    """K and V rows at the same index: ([M, ...], [M, ...])."""
    return k.index_select(0, index), v.index_select(0, index)


def kernels_disabled() -> bool:
    """RADIXSERVE_DISABLE_KERNELS forces the ref twins everywhere."""
    return os.environ.get("RADIXSERVE_DISABLE_KERNELS", "").lower() not in ("", "0", "false", "no")


def gather_impl() -> str:
    """RADIXSERVE_GATHER_IMPL: auto (default), cuda or torch."""
    impl = os.environ.get("RADIXSERVE_GATHER_IMPL", "auto").strip().lower() or "auto"
    if impl not in GATHER_IMPLS:
        raise ValueError(f"RADIXSERVE_GATHER_IMPL must be one of {GATHER_IMPLS}, got {impl!r}")
    return impl


def _resolve(device: torch.device | str):
    """(impl, extension or None, reason): 'ref' with a reason whenever the kernel is not used."""
    device = torch.device(device)
    if kernels_disabled():
        return "ref", None, "RADIXSERVE_DISABLE_KERNELS is set"
    if device.type != "cuda":
        return "ref", None, f"{device.type} device"
    impl = gather_impl()
    if impl == "torch":
        return "ref", None, "RADIXSERVE_GATHER_IMPL=torch"
    from kernels import gather  # NOTE: builds only inside load_extension(), never at import

    ext = gather.load_extension()
    if ext is None:
        return "ref", None, f"gather kernel unavailable: {gather.load_error()}"
    return impl, ext, f"RADIXSERVE_GATHER_IMPL={impl}"


def get_gather_rows(device: torch.device | str) -> GatherFn:
    """The row gather to use on ``device`` (chosen once at model build)."""
    impl, ext, _ = _resolve(device)
    if ext is None:
        return ref_gather_rows
    from kernels import gather

    return gather.make_gather_rows(ext, strided_only=impl == "auto")


def get_gather_rows_pair(device: torch.device | str) -> GatherPairFn:
    """The paired K/V row gather to use on ``device`` (one launch for both on CUDA)."""
    _, ext, _ = _resolve(device)
    if ext is None:
        return ref_gather_rows_pair
    from kernels import gather

    return gather.make_gather_rows_pair(ext)


def describe(device: torch.device | str) -> str:
    """Human-readable name of the gather implementation in use (start-up log, /info)."""
    impl, ext, reason = _resolve(device)
    if ext is None:
        return f"torch index_select ({reason})"
    if impl == "auto":
        return f"cuda gather kernel for K/V pairs and strided rows, torch index_select otherwise ({reason})"
    return f"cuda gather kernel ({reason})"
