"""Thin wrapper around gather.cu: cached JIT build, host-side checks, autograd.

Invariant: nothing here builds or touches CUDA at import. ``load_extension()`` builds once per
process on first CUDA use (into ``$TORCH_EXTENSIONS_DIR/radixserve_gather``, default
``~/.cache/radixserve/torch_extensions``), removes a ``lock`` left by a killed build, and on any
build error logs one warning and returns None forever after, so callers fall back to torch.

NOTE: the kernel does not range-check index values on the device (a check would cost a host
sync per call): an index outside [0, N) reads out of bounds. Model code derives its indices
from a RadixIndex whose contract keeps them in range.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

EXTENSION_NAME = "radixserve_gather"
SOURCE = Path(__file__).with_name("gather.cu")
STALE_LOCK_S = 600.0  # a build takes ~1-3 min; a lock older than this was left by a killed one
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)

_lock = threading.Lock()
_state: dict = {"tried": False, "ext": None, "error": None}


def extension_root() -> Path:
    """Where JIT builds live: $TORCH_EXTENSIONS_DIR, else ~/.cache/radixserve/torch_extensions."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "radixserve" / "torch_extensions"


def clear_stale_lock(build_dir: Path | str, *, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove ``build_dir/lock`` if older than ``max_age_s`` (a killed build's leftover).

    torch's FileBaton waits forever on an existing lock, so a build killed mid-way would hang
    every later process. Returns True when a lock was removed.
    """
    lock = Path(build_dir) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age_s:
        return False
    log.warning("removing stale extension build lock %s (%.0f s old)", lock, age)
    lock.unlink(missing_ok=True)
    return True


def build_now():
    """Compile (or reuse) the extension and stamp it for ``kernels.build.load_prebuilt``."""
    from torch.utils import cpp_extension  # NOTE: imported lazily; never at module import

    from kernels.build import write_stamp

    build_dir = extension_root() / EXTENSION_NAME
    build_dir.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(build_dir)
    ext = cpp_extension.load(
        name=EXTENSION_NAME,
        sources=[str(SOURCE)],
        build_directory=str(build_dir),
        extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr"],
        verbose=False,
    )
    write_stamp(build_dir, EXTENSION_NAME, [SOURCE])
    return ext


def _build():
    """A prebuilt .so whose stamp matches gather.cu (docker image), else a JIT build."""
    from kernels.build import load_prebuilt

    ext = load_prebuilt(EXTENSION_NAME, extension_root() / EXTENSION_NAME, [SOURCE])
    return ext if ext is not None else build_now()


def load_extension():
    """The compiled module, or None when CUDA or the build is unavailable (tried once)."""
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            if not torch.cuda.is_available():
                _state["error"] = "CUDA is not available"
            else:
                try:
                    _state["ext"] = _build()
                except Exception as exc:  # noqa: BLE001 - any build failure means: use torch
                    _state["error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
                    log.warning("gather kernel build failed, using torch: %s", _state["error"])
        return _state["ext"]


def load_error() -> str | None:
    """Why ``load_extension()`` returned None (None when it has not failed)."""
    return _state["error"]


def reset_for_tests() -> None:
    """Forget the cached build attempt (tests only)."""
    with _lock:
        _state.update(tried=False, ext=None, error=None)


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
