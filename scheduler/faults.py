"""What a failed batch means for the process: this batch only, out of memory, or a dead device.

A CUDA fault (an illegal address, a device-side assert, a launch failure) poisons the CUDA
context: every later launch fails too, so failing only that batch would fail all the ones after
it while /health stayed 200. Such errors surface as ordinary exceptions (``torch.AcceleratorError``
in recent torch, a plain ``RuntimeError`` whose message starts "CUDA error:" in older ones), so
they are told apart here by type name and message. Invariant: out of memory is never fatal (the
context is intact: that batch fails, the allocator's cached blocks are released); any other CUDA
error is (the pipeline raises ``DeviceFault``, a BaseException, which ends it: pending work gets
a 503, the server exits non-zero and its supervisor restarts it). Everything else fails its batch.

The scheduler does not import torch: the allocator is reached through ``sys.modules``, only when
the runner's process has loaded torch and initialised CUDA.
"""
from __future__ import annotations

import logging
import sys
from typing import Literal

log = logging.getLogger(__name__)

Fault = Literal["batch", "oom", "fatal"]

# Exception class names (anywhere in the type's MRO) that mean "the device ran out of memory".
_OOM_TYPES = frozenset({"OutOfMemoryError"})
_OOM_TEXT = ("CUDA out of memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED")
# Class names and message fragments of errors raised by the CUDA runtime or its libraries.
_DEVICE_TYPES = frozenset({"AcceleratorError"})
_DEVICE_TEXT = ("CUDA error", "CUBLAS_STATUS_", "CUDNN_STATUS_", "cuDNN error", "device-side assert",
                "an illegal memory access", "unspecified launch failure", "NCCL error")


class DeviceFault(BaseException):
    """The device is unusable (a sticky CUDA error): ends the pipeline; ``__cause__`` is the error."""


def classify(exc: BaseException) -> Fault:
    """"oom" (fails its batch, frees cached blocks), "fatal" (the device is gone) or "batch"."""
    names = {t.__name__ for t in type(exc).__mro__}
    text = str(exc)
    if names & _OOM_TYPES or any(s in text for s in _OOM_TEXT):
        return "oom"
    if names & _DEVICE_TYPES or any(s in text for s in _DEVICE_TEXT):
        return "fatal"
    return "batch"


def release_cached_memory() -> None:
    """After an out-of-memory batch: hand the caching allocator's unused blocks back to the device.

    Its freed segments are often fragments that no request of the failed size fits; releasing them
    lets the next batch allocate afresh. A no-op without torch or before CUDA was initialised.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    try:
        torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001 - releasing is best effort; the batch has failed anyway
        log.warning("could not release cached device memory after out of memory: %s", exc)
