"""`python -m benchmarks.gpu_campaign --phase P --out DIR`: one device command per phase.

Checks that the HTTP stack imports and installs the carried wheels only when it does not (a
failed install stops the phase at once, exit 3; a stack that still does not import, exit 4), then runs the phase's steps (plan.py) each in a child process under the
phase's own deadline, skipping and recording what no longer fits; writes PHASE.md, PHASE.json and
PHASE-logs.tar.gz under --out and prints the table last. Exit 0 when no step failed or timed out.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpu_campaign import budget, plan, prelude, report

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DEADLINE_S = 530.0  # under 9 minutes: under the device tool's 10 with the start and the transfers


def default_deadline(phase: str) -> float:
    """The 15-minute plan's commands end within their budgets (plan.BUDGET_S); the others in 530 s."""
    return plan.BUDGET_S.get(phase, DEFAULT_DEADLINE_S)


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_campaign", description=__doc__.splitlines()[0])
    p.add_argument("--phase", required=True, choices=plan.PHASES)
    p.add_argument("--out", default=os.environ.get("OUT"), help="where the three files go (default $OUT)")
    p.add_argument("--device", default=None, help="cuda (default where available) or cpu: the rehearsal, "
                                                     "tiny fixtures, seconds")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds the phase may take (default: first 420, second 300, the others 530)")
    p.add_argument("--wheels", default=None,
                   help="folder of carried wheels (wheels.txt) to install first; default: .whl in the "
                        "repository on a GPU, none with --device cpu (the wheels are for the device's Python)")
    p.add_argument("--install-wheels", choices=("missing", "always"), default="missing",
                   help="missing (default): install the carried wheels only when the stack does not import")
    p.add_argument("--fixtures", default=None,
                   help="fixture root (default $RADIXSERVE_FIXTURE_DIR, else /tmp/radixserve-fixtures)")
    p.add_argument("--skip", default="", metavar="KIND,...",
                   help="step kinds to leave out, recorded as skipped (arm, ceiling, floor, host, fixture, "
                        "forward, dtypes, gpu_check, exactness, cache)")
    p.add_argument("--step-limit-factor", type=float, default=budget.LIMIT_FACTOR,
                   help="a step is stopped at this many times its estimate (default 2.5); the CPU rehearsal "
                        "on a loaded box raises it, the phase's deadline still holds")
    p.add_argument("--keep-work", default=None, help="keep the logs and request lists in this folder")
    a = p.parse_args(argv)
    if not a.out:
        p.error("--out DIR (or $OUT) is required")
    if a.deadline is None:
        a.deadline = default_deadline(a.phase)
    return a


def _stop(out: Path, phase: str, code: int, error: Exception) -> int:
    """Loudly: on stderr, and as the phase's table so the device tool brings it back."""
    banner = f"CAMPAIGN STOPPED ({phase}): {error}"
    print("=" * 72 + f"\n{banner}\n" + "=" * 72, file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{phase}.md").write_text(f"# radixserve GPU campaign: {phase}\n\n**STOPPED**: {error}\n")
    (out / f"{phase}.json").write_text(json.dumps({"phase": phase, "stopped": str(error), "exit": code}))
    print(f"# radixserve GPU campaign: {phase}\n\n**STOPPED**: {error}")
    return code


def main(argv=None) -> int:
    a = parse_args(argv)
    deadline = budget.Deadline(a.deadline)
    t0 = time.monotonic()
    out = Path(a.out)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    device = a.device or _default_device()
    folder = a.wheels if a.wheels is not None else ("" if device == "cpu" else str(ROOT / ".whl"))
    try:
        wheels = prelude.ensure_imports(Path(folder) if folder else None, always=a.install_wheels == "always")
    except prelude.PreludeError as e:
        return _stop(out, a.phase, 3 if "pip" in str(e) else 4, e)
    if a.fixtures or "RADIXSERVE_FIXTURE_DIR" not in os.environ:
        os.environ["RADIXSERVE_FIXTURE_DIR"] = str(Path(a.fixtures or "/tmp/radixserve-fixtures").resolve())
    env = prelude.describe(device) | {"wheels": wheels}
    s = plan.sizes(device)
    work = Path(a.keep_work) if a.keep_work else Path(tempfile.mkdtemp(prefix=f"campaign-{a.phase}-"))
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    records = []
    try:
        skip = {k.strip() for k in a.skip.split(",") if k.strip()}
        for step in plan.steps(a.phase, s):
            if step.kind in skip:
                records.append({"step": step.name, "kind": step.kind, "need_s": s.need[step.need],
                                "status": "skipped", "seconds": 0.0, "result": None, "why": "--skip"})
                continue
            rec = budget.run_step(step.name, step.kind, step.args | {"device": device}, need_s=s.need[step.need],
                                  deadline=deadline, logs=logs, limit_factor=a.step_limit_factor)
            records.append(rec)
            print(f"[{a.phase}] {step.name}: {rec['status']} ({rec['seconds']} s) {rec.get('why', '')}",
                  file=sys.stderr, flush=True)
        total = time.monotonic() - t0
        md = report.markdown(a.phase, env, records, total, a.deadline)
        doc = {"phase": a.phase, "env": env, "deadline_s": a.deadline, "seconds": total,
               "arms": {k: list(v) for k, v in plan.ARMS.items()}, "steps": records,
               "client_headroom": report.headroom_line(records)[1]}
        report.write(out, a.phase, doc, md, logs)
    finally:
        if not a.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    print(md)
    return 0 if all(r["status"] in ("ok", "skipped") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
