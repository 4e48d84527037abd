"""Row gather for compact <-> full layouts, with pure-torch ``ref_`` twins.

The forward moves rows between the compact (N') and full (N) layouts with gathers along dim 0.
``get_gather_rows(device)`` picks the implementation once, when a model is built; the ``ref_``
twins are the CPU path, the fallback and the test oracle. Gradients flow through every variant.

Which implementation runs on CUDA is set by ``RADIXSERVE_GATHER_IMPL``:
- ``torch``: torch's index_select everywhere, and nothing is built.
- ``cuda``: the custom kernel (kernels/gather.cu) wherever its checks pass, the K/V pair in one
  launch; loaded prebuilt or built on first use, then self-tested (kernels/gather.py).
- ``auto`` (default): an alias for the implementation ``AUTO_GATHER_IMPL`` names, ``torch`` today.
NOTE: the rule is to let ``auto`` use the custom kernel only where a measurement on the GPU shows
it beating torch over a whole forward, not just per gather: a faster gather that leaves the
forward's time unchanged does not pay for a start-up compile on a pip install without a prebuilt
library (docs/decisions.md, "index_select over the custom gather kernel").
``python -m benchmarks.gpu_check`` runs its tests and ``benchmarks.bench_kernels``.

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
AUTO_GATHER_IMPL = "torch"  # what ``auto`` resolves to (see the module docstring)


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
    """(extension or None, reason): None, with the reason, whenever the kernel is not used."""
    device = torch.device(device)
    if kernels_disabled():
        return None, "RADIXSERVE_DISABLE_KERNELS is set"
    if device.type != "cuda":
        return None, f"{device.type} device"
    setting = gather_impl()
    reason = f"RADIXSERVE_GATHER_IMPL={setting}"
    impl = AUTO_GATHER_IMPL if setting == "auto" else setting
    if impl == "torch":
        hint = "; =cuda opts in to the custom kernel" if setting == "auto" else ""
        return None, reason + hint
    from kernels import gather  # NOTE: builds only inside load_extension(), never at import

    ext = gather.load_extension()
    if ext is None:
        return None, f"gather kernel unavailable: {gather.load_error()}"
    return ext, reason


def get_gather_rows(device: torch.device | str) -> GatherFn:
    """The row gather to use on ``device`` (chosen once at model build)."""
    ext, _ = _resolve(device)
    if ext is None:
        return ref_gather_rows
    from kernels import gather

    return gather.make_gather_rows(ext)


def get_gather_rows_pair(device: torch.device | str) -> GatherPairFn:
    """The paired K/V row gather to use on ``device`` (one launch for both on CUDA)."""
    ext, _ = _resolve(device)
    if ext is None:
        return ref_gather_rows_pair
    from kernels import gather

    return gather.make_gather_rows_pair(ext)


def describe(device: torch.device | str) -> str:
    """Human-readable name of the gather implementation in use (start-up log, /info)."""
    ext, reason = _resolve(device)
    if ext is None:
        return f"torch index_select ({reason})"
    return f"cuda gather kernel ({reason})"
