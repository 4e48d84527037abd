"""OpenMP's wait policy for the CPU forward, chosen before torch loads its OpenMP runtime.

torch runs a CPU op's parallel loops on an OpenMP team of one thread per core. With GNU OpenMP's
default, a team thread that reaches the end of a loop spins (GOMP_SPINCOUNT 300,000 turns) before
it sleeps. Whenever another thread wants a core (the event loop parsing a body or rendering an
answer, the tokenizer, any other process on the host), the spinning threads hold the cores the
last team member needs, and each of the forward's hundreds of parallel ops can wait a scheduler
time slice. On the 2-core dev CPU under load a 22-token forward of the test fixture took ~150 ms
instead of ~0.6 ms that way (docs/benchmarks.md, section 10e). ``OMP_WAIT_POLICY=PASSIVE`` makes
a waiting thread sleep at once: a wake-up per op, never a stolen time slice.

Invariant: the user's own setting wins (any of OMP_WAIT_POLICY, GOMP_SPINCOUNT, or Intel
OpenMP's KMP_BLOCKTIME in the environment is left as it is), and the variable is set only while
torch is not yet imported: the runtime reads it once, when torch loads it.
"""
from __future__ import annotations

import os
import sys
from typing import MutableMapping

POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
DEFAULT_POLICY = "PASSIVE"


def apply_wait_policy(environ: MutableMapping[str, str] | None = None) -> str:
    """Set OMP_WAIT_POLICY=PASSIVE unless the user chose a policy or torch is loaded already;
    returns the sentence for the start-up log."""
    env = os.environ if environ is None else environ
    chosen = [f"{name}={env[name]}" for name in POLICY_VARS if name in env]
    if chosen:
        return f"OpenMP wait policy as set in the environment ({', '.join(chosen)})"
    if "torch" in sys.modules:
        return ("OpenMP wait policy left at the runtime's default: torch was imported before the server "
                f"could set OMP_WAIT_POLICY={DEFAULT_POLICY}; set it in the environment instead")
    env["OMP_WAIT_POLICY"] = DEFAULT_POLICY
    return (f"OpenMP wait policy {DEFAULT_POLICY}: threads of the CPU forward sleep at once when they wait, "
            "so they never hold a core another thread needs (set OMP_WAIT_POLICY to choose another)")
