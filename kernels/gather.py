"""Thin wrapper around gather.cu: stamped, self-tested loading, host-side checks, autograd.

Invariant: nothing here builds or touches CUDA at import, and start-up never hangs on a build.
``load_extension()`` (once per process, on first CUDA use):
1. imports the prebuilt library whose stamp (kernels/build.py: sources, torch, CUDA, archs,
   flags) matches this process, and runs a tiny gather on the GPU against index_select;
2. if there is none, or it fails to import or its self-test fails (e.g. "no kernel image is
   available" on an arch outside the built list), rebuilds once, in a subprocess
   (``python -m kernels.build``) killed after ``BUILD_TIMEOUT_S``, then loads and self-tests again;
3. on any failure logs a WARNING naming why and returns None forever after, so callers use torch.

NOTE: the kernel does not range-check index values on the device (a check would cost a host
sync per call): an index outside [0, N) reads out of bounds. Model code derives its indices
from a RadixIndex whose contract keeps them in range.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import Callable

import torch

from kernels import build

log = logging.getLogger(__name__)

EXTENSION = build.GATHER
EXTENSION_NAME = EXTENSION.name
SOURCE = EXTENSION.sources[0]
CUDA_FLAGS = EXTENSION.cuda_flags
BUILD_TIMEOUT_S = 300.0  # the most a start-up waits for a rebuild
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def stamp_fields() -> dict:
    """What a library built here and now would be stamped with."""
    return build.stamp_fields(EXTENSION.sources, EXTENSION.cuda_flags)


def self_test(ext, device: torch.device | str = "cuda") -> str | None:
    """A tiny gather (single and K/V pair, fp32 and bf16, int32 and int64 index) against
    index_select on ``device``; None when it matches, else why not (exceptions included)."""
    try:
        src = torch.arange(7 * 12, dtype=torch.float32).view(7, 3, 4).to(device)
        for dtype in (torch.float32, torch.bfloat16):
            for idx_dtype in INDEX_DTYPES:
                x = src.to(dtype)
                index = torch.tensor([4, 0, 6, 6, 2], dtype=idx_dtype, device=x.device)
                want = x.index_select(0, index)
                got = ext.gather_rows(x, index)
                got_k, got_v = ext.gather_rows_pair(x, x + 1, index)
                if torch.device(device).type == "cuda":
                    torch.cuda.synchronize()  # a bad launch surfaces here, not in a batch
                if not (torch.equal(got, want) and torch.equal(got_k, want)
                        and torch.equal(got_v, want + 1)):
                    return f"self-test: wrong rows ({dtype}, {idx_dtype} index)"
    except Exception as exc:  # noqa: BLE001 - e.g. "no kernel image is available"
        return f"self-test raised {type(exc).__name__}: {str(exc).strip()[:200]}"
    return None


def subprocess_build(timeout_s: float = BUILD_TIMEOUT_S) -> str | None:
    """``python -m kernels.build`` in a subprocess; None on success, else why it failed."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return build.run_build([sys.executable, "-m", "kernels.build"], timeout_s=timeout_s, env=env)


def resolve_library(*, load: Callable, rebuild: Callable[[], str | None],
                    check: Callable[[object], str | None]):
    """(ext, None) or (None, reason): load, self-test, and on any failure rebuild once.

    ``load() -> (ext | None, reason)``, ``rebuild() -> reason | None``, ``check(ext) -> reason |
    None`` are injected so the policy is testable without CUDA.
    """
    ext, why = load()
    if ext is not None:
        why = check(ext)
        if why is None:
            return ext, None
    log.warning("gather kernel library unusable (%s); rebuilding it once", why)
    failed = rebuild()
    if failed is not None:
        return None, f"{why}; rebuild failed: {failed}"
    ext, why = load()
    if ext is None:
        return None, f"after rebuild: {why}"
    why = check(ext)
    return (ext, None) if why is None else (None, f"after rebuild: {why}")


def _load():
    fields = stamp_fields()
    return build.load_prebuilt(EXTENSION_NAME,
                               build.library_dir(build.extension_root(), EXTENSION_NAME, fields), fields)


class Loader:
    """One attempt to load the library (rebuilding it once if need be), made on the first
    ``load()`` and remembered: the extension, or None and ``error`` saying why. Thread-safe.
    The process uses ``LOADER``; a new Loader has made no attempt yet."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tried = False
        self.ext = None
        self.error: str | None = None

    def load(self):
        with self._lock:
            if not self._tried:
                self._tried = True
                if not torch.cuda.is_available():
                    self.error = "CUDA is not available"
                else:
                    self.ext, self.error = resolve_library(load=_load, rebuild=subprocess_build, check=self_test)
                    if self.ext is None:
                        log.warning("gather kernel not used, falling back to torch: %s", self.error)
            return self.ext


LOADER = Loader()


def load_extension():
    """The compiled module, or None when CUDA, the build or the self-test fails (tried once)."""
    return LOADER.load()


def load_error() -> str | None:
    """Why ``load_extension()`` returned None (None when it has not failed)."""
    return LOADER.error


def row_width(src: torch.Tensor) -> int | None:
    """Elements per dim-0 row if the trailing dims are packed (rows contiguous), else None."""
    width = 1
    for d in range(src.dim() - 1, 0, -1):
        if src.size(d) != 1 and src.stride(d) != width:
            return None
        width *= src.size(d)
    return width


def supported(src: torch.Tensor, index: torch.Tensor) -> bool:
    """Host-side metadata checks (no sync): may the kernel take this gather?"""
    return src.is_cuda and index.device == src.device and layout_supported(src, index)


def layout_supported(src: torch.Tensor, index: torch.Tensor) -> bool:
    """The device-independent part of ``supported``: the kernel's own TORCH_CHECKs, mirrored so
    that what it would reject takes index_select instead of raising."""
    if src.dim() < 1 or src.dtype not in DTYPES or index.dtype not in INDEX_DTYPES:
        return False
    if index.dim() != 1 or not index.is_contiguous():
        return False
    width = row_width(src)
    return width is not None and (src.size(0) <= 1 or src.stride(0) >= width)


class GatherRows(torch.autograd.Function):
    """out = launch(src, index); backward = zeros + index_add_ of the grad rows."""

    @staticmethod
    def forward(ctx, src, index, launch):
        ctx.save_for_backward(index)
        ctx.src_shape = src.shape
        return launch(src, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        grad_src = grad.new_zeros(ctx.src_shape).index_add_(0, index, grad)
        return grad_src, None, None


class GatherRowsPair(torch.autograd.Function):
    """(k[index], v[index]) through ``launch_pair``; backward scatters both grads."""

    @staticmethod
    def forward(ctx, k, v, index, launch_pair):
        ctx.save_for_backward(index)
        ctx.shapes = (k.shape, v.shape)
        out_k, out_v = launch_pair(k, v, index)
        return out_k, out_v

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        (index,) = ctx.saved_tensors
        k_shape, v_shape = ctx.shapes
        need_k, need_v = ctx.needs_input_grad[:2]
        gk = grad_k.new_zeros(k_shape).index_add_(0, index, grad_k) if need_k else None
        gv = grad_v.new_zeros(v_shape).index_add_(0, index, grad_v) if need_v else None
        return gk, gv, None, None


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def make_gather_rows(ext):
    """A gather fn over ``ext``; inputs the kernel does not support take torch's index_select."""

    def launch(src, index):
        return ext.gather_rows(src, index)

    def gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if not supported(src, index):
            return src.index_select(0, index)
        if _needs_grad(src):
            return GatherRows.apply(src, index, launch)
        return launch(src, index)

    return gather_rows


def make_gather_rows_pair(ext):
    """A paired K/V gather over ``ext`` (one launch); unsupported inputs take index_select."""

    def launch_pair(k, v, index):
        out_k, out_v = ext.gather_rows_pair(k, v, index)
        return out_k, out_v

    def gather_rows_pair(k: torch.Tensor, v: torch.Tensor, index: torch.Tensor):
        ok = (supported(k, index) and supported(v, index) and k.dtype == v.dtype
              and k.size(0) == v.size(0))
        if not ok:
            return k.index_select(0, index), v.index_select(0, index)
        if _needs_grad(k, v):
            return GatherRowsPair.apply(k, v, index, launch_pair)
        return launch_pair(k, v, index)

    return gather_rows_pair
