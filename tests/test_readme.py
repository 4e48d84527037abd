"""README's two set-up commands stay true (CI runs the same test command, the demo preset exists),
and its API examples answer as written: each curl command and the OpenAI SDK example run against
real servers started as the set-up command starts the demo (an embedding checkpoint, no
--served-model-name), the rerank examples against the tiny-reranker fixture."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.client_checks import CACHE_ATOL

ROOT = Path(__file__).resolve().parents[1]


def setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)


def test_exactly_two_setup_commands():
    cmds = setup_commands()
    assert len(cmds) == 2 and all("\n" not in c for c in cmds), cmds
    assert "radixserve --model-id" in cmds[0]
    assert "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command():
    readme_pytest = setup_commands()[1].split("&&")[-1].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^{re.escape(readme_pytest)}(\s|$)", ci, flags=re.M), readme_pytest
    assert "torch==2.13.0" in setup_commands()[1] and "torch==2.13.0" in ci


def test_server_command_names_a_real_preset_and_flags():
    from fixtures import PRESETS
    from server.cli import build_parser

    words = shlex.split(setup_commands()[0].replace("&&", " && "))
    preset = words[words.index("--preset") + 1]
    assert preset in PRESETS
    serve = words[words.index("radixserve"):]
    args = build_parser().parse_args(serve[1:])
    assert args.model_id == words[words.index("fixtures") + 1]


# -- the API examples, run as written against real servers -----------------------------------------
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")


def api_section() -> str:
    return (ROOT / "README.md").read_text().split("\n## API\n", 1)[1].split("\n## ", 1)[0]


def curl_examples() -> list[str]:
    """The curl commands of the API section's shell block, continuation lines joined, comments left out."""
    block = re.search(r"```bash\n(.*?)\n```", api_section(), flags=re.S).group(1)
    joined = re.sub(r"\\\n\s*", "", block)
    cmds = [re.sub(r"\s+#.*$", "", ln).strip() for ln in joined.splitlines()]
    return [c for c in cmds if c.startswith("curl ")]


def sdk_example() -> str:
    return re.search(r"```python\n(from openai import OpenAI\n.*?)\n```", api_section(), flags=re.S).group(1)


@pytest.fixture(scope="module")
def readme_servers(tiny_embedding_dir, tiny_reranker_dir):
    """As the README starts them: no --served-model-name (the set-up command's demo server)."""
    from tests.serving import serve

    started = {"embedding": serve(tiny_embedding_dir), "reranker": serve(tiny_reranker_dir)}
    yield started
    for srv in started.values():
        srv.stop()


def test_the_readme_has_the_examples_this_file_runs():
    paths = {re.search(r"localhost:8080(/\S*)", c).group(1) for c in curl_examples()}
    assert len(curl_examples()) >= 15 and {"/v1/embeddings", "/v1/rerank", "/embed", "/rerank"} <= paths
    assert 'OpenAI(base_url="http://localhost:8080/v1"' in sdk_example()


@pytest.mark.parametrize("cmd", curl_examples(), ids=lambda c: re.search(r"localhost:8080(/\S*)", c).group(1))
def test_each_curl_example_answers_as_written(readme_servers, cmd):
    """The command as the README writes it (host and port the fixture's; MODEL_ID the id /v1/models
    lists), with --fail-with-body so an HTTP error fails it; a JSON answer must parse."""
    path = re.search(r"localhost:8080(/\S*)", cmd).group(1).strip("'\"")
    srv = readme_servers["reranker" if path in RERANK_PATHS else "embedding"]
    served = httpx.get(srv.url + "/v1/models", timeout=120).json()["data"][0]["id"]
    run = cmd.replace("localhost:8080", srv.url.removeprefix("http://"), 1).replace("MODEL_ID", served)
    run = run.replace("curl ", "curl --fail-with-body ", 1)
    out = subprocess.run(["bash", "-c", run], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (run, out.stdout[-2000:], out.stderr[-2000:])
    if path not in ("/health", "/metrics"):
        json.loads(out.stdout)


def test_the_openai_sdk_example_runs_as_written(readme_servers, capsys):
    pytest.importorskip("openai")
    srv = readme_servers["embedding"]
    code = sdk_example().replace("http://localhost:8080", srv.url)
    exec(compile(code, "README.md (OpenAI SDK example)", "exec"), {})
    n, size, tokens = map(int, capsys.readouterr().out.split())
    assert (n, size) == (2, 32) and tokens > 0
    want = httpx.post(srv.url + "/embed", json={"inputs": ["hello", "world"], "dimensions": 32}, timeout=300).json()
    got = httpx.post(srv.url + "/v1/embeddings", timeout=300, json={
        "model": "Qwen/Qwen3-Embedding-0.6B", "input": ["hello", "world"], "dimensions": 32}).json()
    np.testing.assert_allclose([d["embedding"] for d in got["data"]], want, atol=CACHE_ATOL)
