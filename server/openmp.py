"""OpenMP's wait policy for the CPU forward, chosen before torch loads its OpenMP runtime.

torch runs a CPU op's parallel loops on an OpenMP team of one thread per core. With GNU OpenMP's
default, a team thread that reaches the end of a loop spins 300,000 turns before it sleeps.
Whenever another thread wants a core (the event loop parsing a body or rendering an answer, the
tokenizer, any other process on the host), the spinning threads hold the cores the last team
member needs, and each of the forward's hundreds of parallel ops can wait a scheduler time slice.
With two busy processes on the 2-core dev CPU, a 16-input forward of the 0.6B-shaped fixture took
883 ms that way; with 10,000 turns it took 103 ms, and on the idle CPU 1-4% longer than with the
default (docs/benchmarks.md, section 10e). Sleeping at once (OMP_WAIT_POLICY=PASSIVE) does best
under contention but costs 20-200% on an idle CPU, where a wake-up per op is most of a short op.

Invariant: the user's own setting wins (any of OMP_WAIT_POLICY, GOMP_SPINCOUNT, or Intel
OpenMP's KMP_BLOCKTIME in the environment is left as it is), and the variable is set only while
torch is not yet imported: the runtime reads it once, when torch loads it.
"""
from __future__ import annotations

import os
import sys
from typing import MutableMapping

POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
SPIN_TURNS = "10000"  # GOMP_SPINCOUNT: ~10-30 us of spinning on the dev CPU, then sleep


def apply_wait_policy(environ: MutableMapping[str, str] | None = None) -> str:
    """Set GOMP_SPINCOUNT=10000 unless the user chose a policy or torch is loaded already;
    returns the sentence for the start-up log."""
    env = os.environ if environ is None else environ
    chosen = [f"{name}={env[name]}" for name in POLICY_VARS if name in env]
    if chosen:
        return f"OpenMP wait policy as set in the environment ({', '.join(chosen)})"
    if "torch" in sys.modules:
        return ("OpenMP wait policy left at the runtime's default: torch was imported before the server "
                f"could set GOMP_SPINCOUNT={SPIN_TURNS}; set it in the environment instead")
    env["GOMP_SPINCOUNT"] = SPIN_TURNS
    return (f"OpenMP wait policy GOMP_SPINCOUNT={SPIN_TURNS} (the runtime's default 300000): threads of the CPU "
            "forward spin briefly, then sleep, so they do not hold cores other threads need "
            "(set OMP_WAIT_POLICY or GOMP_SPINCOUNT to choose another)")
