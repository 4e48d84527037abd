"""One step of a phase, run as a child process by budget.run_step:

    python -m benchmarks.gpu_campaign.steps KIND ARGS_JSON RESULT_JSON

ARGS_JSON carries the step's arguments plus `device`, `deadline_at` (wall clock) and `logs`;
the result is written to RESULT_JSON only when the step finishes. SIGTERM raises SystemExit, so
servers and responders the step started are stopped on the way out.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from benchmarks.gpu_campaign import plan

STORE_DTYPE = "bfloat16"  # fixtures on disk as the hub ships Qwen3


def model_dir(s: plan.Sizes, role: str, kind: str = "embedding", *, build: bool = False,
              drawn: bool = False) -> Path:
    """The role's random-weight checkpoint in the fixture cache; built only by the fixture step.
    drawn: the weights drawn on the phase's device and streamed to disk (the 15-minute plan)."""
    import fixtures
    from fixtures.checkpoint import cache_key, default_root

    preset = s.preset(role)
    if kind == "reranker":
        preset = preset.replace("embedding", "reranker")
    draw = s.device if drawn else None
    path = default_root() / cache_key(preset, layers=s.layers, kind=kind, dtype=STORE_DTYPE, draw_device=draw)
    if build:
        return fixtures.cached(preset, layers=s.layers, kind=kind, dtype=STORE_DTYPE, draw_device=draw)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no {role} {kind} fixture at {path}: its fixture step did not run")
    return path


def fixture(s: plan.Sizes, a: dict) -> dict:
    t0 = time.perf_counter()
    existed = True
    try:
        model_dir(s, a["role"], a["kind"], drawn=a.get("drawn", False))
    except FileNotFoundError:
        existed = False
    path = model_dir(s, a["role"], a["kind"], build=True, drawn=a.get("drawn", False))
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return {"path": str(path), "built": not existed, "seconds": time.perf_counter() - t0, "bytes": size}


def run(kind: str, a: dict) -> dict:
    s = plan.sizes(a["device"])
    logs, deadline_at = Path(a["logs"]), float(a["deadline_at"])
    work = logs.parent / "work"
    work.mkdir(exist_ok=True)
    if kind == "fixture":
        return fixture(s, a)
    if kind == "sleep":  # only waits, in a grandchild too: rehearses a step stopped at its limit
        import subprocess

        child = subprocess.Popen(["sleep", str(a["seconds"])])
        (logs / "sleep.pid").write_text(str(child.pid))
        child.wait()
        return {"slept": a["seconds"]}
    if kind == "frontends":
        from benchmarks.gpu_campaign import e2e

        return e2e.frontends(s, logs=logs, deadline_at=deadline_at)
    drawn = bool(a.get("drawn"))
    if kind == "arms":
        from benchmarks.gpu_campaign import arms

        return arms.side_by_side(s, model_dir(s, a["role"], drawn=drawn), arms=a["arms"], logs=logs, work=work,
                                 deadline_at=deadline_at, role=a["role"])
    if kind in ("arm", "ceiling", "floor", "host"):
        from benchmarks.gpu_campaign import e2e

        if kind == "arm":
            return e2e.arm(s, model_dir(s, a["role"]), arm=a["arm"], duration=a["duration"], logs=logs,
                           work=work, deadline_at=deadline_at, role=a["role"])
        if kind == "ceiling":
            workers = 4 if s.device.startswith("cuda") else 1
            return e2e.ceiling(s, role=a["role"], duration=a["duration"], work=work, workers=workers)
        if kind == "floor":
            return e2e.floor(s, model_dir(s, a["role"], a["kind"], drawn=drawn), kind=a["kind"], logs=logs,
                             deadline_at=deadline_at)
        return e2e.host(s, model_dir(s, a["role"]), work=work, threads=max(1, (os.cpu_count() or 2) - 1))
    if kind == "graphs":
        from benchmarks.gpu_campaign import graphs

        return graphs.one_input(s, model_dir(s, a["role"], drawn=drawn), deadline_at=deadline_at)
    if kind in ("forward", "dtypes"):
        from benchmarks.gpu_campaign import forward

        if kind == "forward":
            return forward.forward_big(s, model_dir(s, a["role"], drawn=drawn), deadline_at=deadline_at)
        return forward.dtypes(s, {r: model_dir(s, r, drawn=drawn) for r in a["roles"]}, deadline_at=deadline_at)
    from benchmarks.gpu_campaign import checks

    if kind == "gpu_check":
        return checks.gpu_check(s, logs=logs, deadline_at=deadline_at)
    if kind == "exactness":
        return checks.exactness(s, model_dir(s, a["role"]), deadline_at=deadline_at)
    if kind == "cache":
        return checks.cache_speed(s, model_dir(s, a["role"]), deadline_at=deadline_at)
    if kind == "launches":
        return checks.launches(s, model_dir(s, a["role"], drawn=drawn))
    raise ValueError(f"unknown step kind {kind!r}")


def _sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    kind, args, result_path = argv[0], json.loads(argv[1]), Path(argv[2])
    signal.signal(signal.SIGTERM, _sigterm)
    result = run(kind, args)
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.rename(result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
