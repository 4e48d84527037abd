"""Process-wide settings every serving process applies at start (the single-process server, the
engine of --api-server-count, each front end): the GIL switch interval, and start-up objects
frozen out of the garbage collector. Imported by server/cli.py and server/frontends/frontend.py
alike, so neither climbs up to the other.
"""
from __future__ import annotations

import gc
import logging
import sys
import time

log = logging.getLogger("radixserve.server")


# The GIL switch interval of a serving process (Python's default: 5 ms). The worker's forward
# releases and retakes the GIL around each of its hundreds of ops; while parsing and prep threads
# run pure Python, each retake could wait a whole interval (docs/decisions.md, "The GIL switch
# interval").
SWITCH_INTERVAL_S = 0.0005


def tune_switch_interval() -> None:
    default = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    log.info("GIL switch interval %.2f ms (Python's default %.2f ms), so the model worker's ops wait less "
             "behind threads running Python", SWITCH_INTERVAL_S * 1e3, default * 1e3)


def freeze_startup_objects() -> None:
    """Move everything alive after start-up (modules, the model, the app) out of the collector's
    reach: a full collection walks every one of them (hundreds of thousands of objects in a loaded
    server), a pause on whichever thread (and, holding the GIL, on the event loop) it falls.
    Objects made while serving are collected as before."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info("froze %d start-up objects out of garbage collection (%.0f ms)", gc.get_freeze_count(),
             (time.perf_counter() - t0) * 1e3)
