"""The phase's own deadline: each step runs in a child process only when its estimate fits the
time left, under a hard timeout, and is recorded either way (ran, failed, timed out, skipped).

A step is `python -m benchmarks.gpu_campaign.steps KIND ARGS_JSON RESULT_JSON` in a process
group of its own, so a timeout ends it and the servers it started together (SIGTERM first, which
the child turns into SystemExit so its servers are stopped, SIGKILL to the group after a grace).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 10.0  # from SIGTERM to SIGKILL of a step's process group
LIMIT_FACTOR = 2.5  # a step is stopped at this many times its estimate (at least estimate + 60 s)
RESERVE_S = 8.0  # kept back for the report, the tarball and the exit


class Deadline:
    """Seconds left before the phase must be writing its report."""

    def __init__(self, seconds: float, reserve: float = RESERVE_S) -> None:
        self.end = time.monotonic() + seconds
        self.reserve = reserve

    def left(self) -> float:
        return self.end - self.reserve - time.monotonic()

    def at(self) -> float:
        """The same moment on the wall clock (what a child process can compare against)."""
        return time.time() + self.left()


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(name: str, kind: str, args: dict, *, need_s: float, deadline: Deadline, logs: Path,
             env: dict | None = None, limit_factor: float = LIMIT_FACTOR) -> dict:
    """Run one step if `need_s` fits; its record: status ok | failed | timeout | skipped, seconds,
    the reason, and the child's JSON result (None when it wrote none)."""
    left = deadline.left()
    rec: dict = {"step": name, "kind": kind, "need_s": need_s}
    if left < need_s:
        return rec | {"status": "skipped", "seconds": 0.0, "result": None,
                      "why": f"needs ~{need_s:.0f} s, {max(0.0, left):.0f} s left"}
    timeout = min(left, max(limit_factor * need_s, need_s + 60.0))
    result_path = logs / f"{name}.json"
    argv = [sys.executable, "-m", "benchmarks.gpu_campaign.steps", kind,
            json.dumps(args | {"deadline_at": time.time() + timeout - GRACE_S, "logs": str(logs)}), str(result_path)]
    t0 = time.monotonic()
    with (logs / f"{name}.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env if env is not None else os.environ.copy())
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            rc = None
        finally:
            if proc.poll() is None:
                _stop_group(proc)
    result = json.loads(result_path.read_text()) if result_path.is_file() else None
    status = "timeout" if rc is None else ("ok" if rc == 0 else "failed")
    why = (f"stopped at its {timeout:.0f} s limit" if rc is None else
           "" if rc == 0 else f"exit {rc}: " + _tail(logs / f"{name}.log"))
    return rec | {"status": status, "seconds": round(time.monotonic() - t0, 1), "result": result, "why": why}


def _tail(path: Path, chars: int = 400) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-3:])[-chars:]
