"""Row gather for compact <-> full layouts, with pure-torch ``ref_`` twins.

The forward moves rows between the compact (N') and full (N) layouts with gathers along dim 0.
``get_gather_rows(device)`` picks the implementation once, when a model is built; the ``ref_``
twins are the CPU path, the fallback and the test oracle. Gradients flow through every variant.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

GatherFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
GatherPairFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]


def ref_gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """src [N, ...], index [M] -> [M, ...] (autograd through index_select)."""
    return src.index_select(0, index)


def ref_gather_rows_pair(k: torch.Tensor, v: torch.Tensor, index: torch.Tensor):
    """K and V rows at the same index: ([M, ...], [M, ...])."""
    return k.index_select(0, index), v.index_select(0, index)


def kernels_disabled() -> bool:
    """RADIXSERVE_DISABLE_KERNELS forces the ref twins everywhere."""
    return os.environ.get("RADIXSERVE_DISABLE_KERNELS", "").lower() not in ("", "0", "false", "no")


def get_gather_rows(device: torch.device | str) -> GatherFn:
    """The row gather to use on ``device`` (chosen once at model build)."""
    return ref_gather_rows


def get_gather_rows_pair(device: torch.device | str) -> GatherPairFn:
    """The paired K/V row gather to use on ``device``."""
    return ref_gather_rows_pair


def describe(device: torch.device | str) -> str:
    """Human-readable name of the gather implementation in use (start-up log, /info)."""
    return "torch index_select"
