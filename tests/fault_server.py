"""``python -m tests.fault_server RADIXSERVE_FLAGS...``: the radixserve CLI with faults in its runner.

The real-process tests (tests/test_server_lifecycle.py) start the server through this module to
give it long or fatal forwards; the product has no fault hooks. RADIXSERVE_TEST_FAULT holds
comma-separated directives:
- ``slow_forward=S``: every forward sleeps S seconds first (long in-flight work for drain tests);
- ``die_on_forward=N``: the N-th forward raises ``InjectedDeath``, a BaseException, in the model
  worker thread: the scheduler dies for good, as on a fatal CUDA error.
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


def inject_faults(runner, environ=None):
    """``runner``, or a copy whose ``run`` misbehaves as RADIXSERVE_TEST_FAULT says."""
    spec = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not spec:
        return runner
    directives = dict(part.split("=", 1) for part in spec.split(",") if part.strip())
    unknown = set(directives) - {"slow_forward", "die_on_forward"}
    if unknown:
        raise ValueError(f"{ENV}: unknown directive(s) {sorted(unknown)}")
    delay = float(directives.get("slow_forward", 0))
    die_on = int(directives.get("die_on_forward", 0))
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
