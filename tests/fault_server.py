"""``python -m tests.fault_server RADIXSERVE_FLAGS...``: the radixserve CLI with faults in its runner.

The real-process tests (tests/test_server_lifecycle.py) start the server through this module to
give it long or fatal forwards; the product has no fault hooks. RADIXSERVE_TEST_FAULT holds
comma-separated directives:
- ``slow_forward=S``: every forward sleeps S seconds first (long in-flight work for drain tests);
- ``die_on_forward=N``: the N-th forward raises ``InjectedDeath``, a BaseException, in the model
  worker thread: the scheduler dies for good (any escape from the per-batch guards);
- ``cuda_error_on_forward=N:KIND``: the N-th forward raises, from inside ``run``, the exception
  type torch raises for a real CUDA failure with CUDA's own message: KIND ``illegal`` (an illegal
  memory access, ``torch.AcceleratorError``), ``assert`` (a device-side assert, a plain
  ``RuntimeError`` as older torch raises it) or ``oom`` (``torch.OutOfMemoryError``).
The runner the CLI loads (``server.app.load_runner``) is wrapped before the app is built.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time

log = logging.getLogger("radixserve.server")

ENV = "RADIXSERVE_TEST_FAULT"


class InjectedDeath(BaseException):
    """Escapes the per-batch ``except Exception``: takes the pipeline down."""


# What torch raises on a real CUDA failure: the type and the text of its message.
ILLEGAL_ADDRESS = ("CUDA error: an illegal memory access was encountered\n"
                   "CUDA kernel errors might be asynchronously reported at some other API call, so the "
                   "stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
                   "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")
DEVICE_ASSERT = ("CUDA error: device-side assert triggered\n"
                 "CUDA kernel errors might be asynchronously reported at some other API call, so the "
                 "stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
                 "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")
OUT_OF_MEMORY = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of "
                 "which 1.21 GiB is free. Including non-PyTorch memory, this process has 77.97 GiB memory in "
                 "use. Of the allocated memory 75.40 GiB is allocated by PyTorch, and 1.93 GiB is reserved by "
                 "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def cuda_error(kind: str) -> Exception:
    """The exception torch raises for a CUDA failure of this kind: illegal, assert or oom."""
    import torch

    if kind == "illegal":
        return torch.AcceleratorError(ILLEGAL_ADDRESS)
    if kind == "assert":
        return RuntimeError(DEVICE_ASSERT)
    if kind == "oom":
        return torch.OutOfMemoryError(OUT_OF_MEMORY)
    raise ValueError(f"{ENV}: unknown CUDA error kind {kind!r}; use illegal, assert or oom")


def inject_faults(runner, environ=None):
    """``runner``, or a copy whose ``run`` misbehaves as RADIXSERVE_TEST_FAULT says."""
    spec = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not spec:
        return runner
    directives = dict(part.split("=", 1) for part in spec.split(",") if part.strip())
    unknown = set(directives) - {"slow_forward", "die_on_forward", "cuda_error_on_forward"}
    if unknown:
        raise ValueError(f"{ENV}: unknown directive(s) {sorted(unknown)}")
    delay = float(directives.get("slow_forward", 0))
    die_on = int(directives.get("die_on_forward", 0))
    fault_on, _, fault_kind = directives.get("cuda_error_on_forward", "0:").partition(":")
    fault_n = int(fault_on)
    if fault_n:
        cuda_error(fault_kind)  # a bad kind fails at start
    log.warning("%s=%s: test-only faults are injected into the model runner", ENV, spec)
    inner = runner.run
    calls = 0
    lock = threading.Lock()

    def faulty_run(batch):
        nonlocal calls
        with lock:
            calls += 1
            n = calls
        if die_on and n == die_on:
            raise InjectedDeath(f"{ENV}: injected death on forward {n}")
        time.sleep(delay)
        if fault_n and n == fault_n:  # after the delay: a forward that runs a while, then faults
            raise cuda_error(fault_kind)
        return inner(batch)

    copy = dataclasses.replace(runner)
    copy.run = faulty_run
    return copy


def main(argv: list[str] | None = None) -> int:
    from server import app, cli

    load = app.load_runner
    app.load_runner = lambda config: inject_faults(load(config))
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
