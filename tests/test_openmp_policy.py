"""The server's OpenMP wait policy reaches the OpenMP runtime torch loads, and a user's own wins.

GNU OpenMP prints the wait settings it read when OMP_DISPLAY_ENV=VERBOSE: GOMP_SPINCOUNT '0' is
PASSIVE, '300000' the runtime's default, '30000000000' ACTIVE, '10000' the server's choice.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from server.openmp import apply_wait_policy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _spin_count(code: str, **env: str) -> tuple[str, str]:
    """(GOMP_SPINCOUNT the runtime reports, the process's stdout) for ``code`` in a fresh python."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **env})
    found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", proc.stderr)
    if found is None:
        pytest.skip("this torch build's OpenMP runtime is not GNU OpenMP (no OMP_DISPLAY_ENV report)")
    return found.group(1), proc.stdout


SERVE_ORDER = ("from server.openmp import apply_wait_policy; print(apply_wait_policy()); "
               "import torch; torch.ones(64).sum()")


def test_passive_unless_chosen_reaches_the_runtime():
    default, _ = _spin_count("import torch; torch.ones(64).sum()")
    assert default == "300000"  # the runtime's own default
    spin, out = _spin_count(SERVE_ORDER)
    assert spin == "10000" and "GOMP_SPINCOUNT=10000" in out
    spin, out = _spin_count(SERVE_ORDER, OMP_WAIT_POLICY="PASSIVE")
    assert spin == "0" and "OMP_WAIT_POLICY=PASSIVE" in out
    spin, out = _spin_count(SERVE_ORDER, OMP_WAIT_POLICY="ACTIVE")
    assert spin == "30000000000" and "OMP_WAIT_POLICY=ACTIVE" in out
    spin, out = _spin_count(SERVE_ORDER, GOMP_SPINCOUNT="1000")
    assert spin == "1000" and "GOMP_SPINCOUNT=1000 " not in out and "(GOMP_SPINCOUNT=1000)" in out


def test_the_cli_applies_it_before_torch_loads(tmp_path):
    # main() fails on the missing model after importing the app (and torch): the runtime has read
    # the policy by then.
    spin, _ = _spin_count(f"import sys; from server.cli import main; sys.exit(main(['--model-id', '{tmp_path}/none']))")
    assert spin == "10000"


def test_too_late_once_torch_is_loaded():
    import torch  # noqa: F401 - this test process has torch loaded

    env: dict[str, str] = {}
    note = apply_wait_policy(env)
    assert env == {} and "torch was imported before" in note
    assert "KMP_BLOCKTIME=0" in apply_wait_policy({"KMP_BLOCKTIME": "0"})
