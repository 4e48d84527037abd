"""The load tester checks its optional packages before any work: with matplotlib (or pyarrow)
not importable, the README's `compare` exits 2 at once naming the package and the `loadtest`
extra, and starts no server; `--no-plot` runs everything but the PNG."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest import cli, needs
from tests.test_loadtest_ux import _FAKE_SERVER

ROOT = Path(__file__).resolve().parents[1]


def _blocked(tmp_path: Path, module: str) -> dict:
    """An environment where `import module` raises ImportError: a package of that name that
    refuses to import, ahead of site-packages on PYTHONPATH."""
    pkg = tmp_path / "blocked" / module
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"raise ImportError('{module} blocked by the test')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path / "blocked"), str(ROOT), env.get("PYTHONPATH")]))
    return env


def _compare(tmp_path: Path, marker: Path, *extra: str) -> list[str]:
    """The README's compare shape against a stand-in server that leaves `marker` when started."""
    server = f"import pathlib; pathlib.Path({str(marker)!r}).touch()\n" + _FAKE_SERVER
    return [sys.executable, "-m", "loadtest.cli", "compare", "--model-id", str(tmp_path),
            "--server-cmd", shlex.join([sys.executable, "-c", server]), "--server", "a: ",
            "--workload", "rerank", "--source", "synthetic", "--queries", "3", "--requests", "4",
            "--warmup", "0", "--concurrency", "2", "--startup-timeout", "60", "--quiet",
            "--out", str(tmp_path / "out"), *extra]


def test_compare_without_matplotlib_stops_before_starting_a_server(tmp_path):
    marker = tmp_path / "server-started"
    res = subprocess.run(_compare(tmp_path, marker), cwd=ROOT, env=_blocked(tmp_path, "matplotlib"),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "matplotlib is not installed" in res.stderr and 'pip install -e ".[loadtest]"' in res.stderr
    assert "--no-plot" in res.stderr
    assert "Traceback" not in res.stderr
    assert not marker.exists()  # no server was started
    assert not (tmp_path / "out").exists()  # nothing was written


def test_compare_no_plot_runs_without_matplotlib(tmp_path):
    marker = tmp_path / "server-started"
    res = subprocess.run(_compare(tmp_path, marker, "--no-plot"), cwd=ROOT,
                         env=_blocked(tmp_path, "matplotlib"), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert marker.exists()
    [run] = json.loads((tmp_path / "out" / "report.json").read_text())["runs"]
    assert (run["name"], run["requests_ok"]) == ("a", 4)
    assert (tmp_path / "out" / "report.md").is_file() and not (tmp_path / "out" / "report.png").exists()


def test_parquet_without_pyarrow_fails_before_the_target_is_probed(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ImportError
    data = tmp_path / "msmarco.parquet"
    data.write_bytes(b"PAR1")
    # a dead URL: were it probed first, the error would be about the target instead
    rc = cli.main(["run", "--url", "http://127.0.0.1:9", "--source", "file", "--dataset-path", str(data)])
    err = capsys.readouterr().err
    assert rc == 2 and "pyarrow is not installed" in err and f"reading {data}" in err
    assert 'pip install -e ".[loadtest]"' in err and "not reachable" not in err.lower()


@pytest.mark.parametrize("argv, want", [
    (["run", "--url", "http://x", "--out", "o"], ["matplotlib"]),
    (["run", "--url", "http://x", "--out", "o", "--no-plot"], []),
    (["run", "--url", "http://x"], []),  # no --out: no PNG
    (["compare", "--dataset-path", "d.PARQUET"], ["pyarrow"]),
    (["compare", "--source", "synthetic", "--dataset-path", "d.parquet"], []),  # the path is not read
    (["dataset", "--source", "hf", "--out", "x.jsonl"], ["datasets"]),
    (["dataset", "--out", "x.jsonl"], []),  # auto falls back to synthetic without `datasets`
    (["soak", "--target", "http://x", "--duration", "1", "--out", "o"], []),
    (["compare", "--baseline"], ["transformers"]),  # the transformers peer
    (["compare", "--server", "peer@9000:@baseline --x", "--server", "r: --radix-mlp-threshold 0"], ["transformers"]),
    (["compare", "--server", "r: --radix-mlp-threshold 0"], []),
])
def test_needs_follow_the_arguments(argv, want):
    a = cli.build_parser().parse_args(argv)
    assert [n.module for n in needs.needs(a)] == want
