"""Helpers of the batch-job tests: batch files, running ``radixserve-batch`` in-process, comparing answers."""
from __future__ import annotations

import json
import math
from pathlib import Path

IGNORED = frozenset({"id", "created"})  # fresh per answer (uuid, clock) in some dialects


def write_batch(path: Path, rows: list) -> Path:
    """Each row a dict (one JSON line) or a str (written as is)."""
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def read_out(path: Path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def run_cli(runner, model_dir, inp, out, *extra: str) -> int:
    from server.batch.command import main

    return main(["-i", str(inp), "-o", str(out), "--model", str(model_dir), "--no-progress", *extra], runner=runner)


def same(a, b, *, path: str = "") -> None:
    """``a`` equals ``b`` as JSON, floats within 1e-4 relative (batch composition moves the last bits)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            if k not in IGNORED:
                same(a[k], b[k], path=f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, path=f"{path}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5), f"{path}: {a} != {b}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
