"""Launch to healthy: start ``python -m server.cli`` on a checkpoint, poll GET /health, print seconds.

    python -m benchmarks.cold_start DIR [--runs 2] [--pythonpath OTHER_TREE]

Each run is a fresh process on a free port; the best run is printed with every run's figure.
``--pythonpath`` alternates runs of another source tree with this one (its figure first), so a
shared machine's load hits both alike.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: str, pythonpath: str | None, timeout: float) -> tuple[float, dict]:
    """Seconds from spawn to the first 200 of /health, and /info's ``startup`` (or {})."""
    port = free_port()
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath  # and run there: `python -m` puts the working directory first
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "--model-id", os.path.abspath(model), "--port", str(port),
                             "--hostname", "127.0.0.1"], env=env, cwd=pythonpath or None, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with status {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        took = time.perf_counter() - t0
                        with urllib.request.urlopen(f"http://127.0.0.1:{port}/info", timeout=5) as i:
                            return took, json.load(i).get("startup", {})
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"not healthy after {timeout} s")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--pythonpath", help="another source tree, run alternately with this one")
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    trees = ([("other", args.pythonpath)] if args.pythonpath else []) + [("this", os.environ.get("PYTHONPATH") or os.getcwd())]
    seen: dict[str, list[float]] = {name: [] for name, _ in trees}
    for _ in range(args.runs):
        for name, path in trees:
            took, stages = launch(args.model, path, args.timeout)
            seen[name].append(took)
            print(f"{name}: {took:.2f} s" + (f"  stages {json.dumps(stages)}" if stages else ""), flush=True)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    for name, runs in seen.items():
        print(f"{name}: best {min(runs):.2f} s of {', '.join(f'{t:.2f}' for t in runs)} (load {' '.join(load)})")


if __name__ == "__main__":
    main()
