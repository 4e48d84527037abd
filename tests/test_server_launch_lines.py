"""vLLM's and Infinity's launch lines: ``radixserve serve MODEL ...`` and ``radixserve v2 ...`` parse
to our flags with their meaning; a flag that cannot mean anything here exits 2 with a sentence naming
ours; no abbreviations; flags are checked before torch is imported; --task refuses a checkpoint of
the other kind at start (a real process)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.cli import load_config
from server.config import ServerConfig

ROOT = Path(__file__).resolve().parents[1]


def _refusal(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as info:
        load_config(argv, environ={})
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" not in err  # one sentence, not argparse's flag list
    return err


def test_a_vllm_embedding_line_maps_to_our_flags():
    config, notes = load_config(
        ["serve", "Qwen/Qwen3-Embedding-0.6B", "--task", "embed", "--runner", "pooling", "--max-model-len", "512",
         "--trust-remote-code", "--dtype", "auto", "--served-model-name", "qwen", "emb", "--api-key", "k3y",
         "--host", "127.0.0.1", "--port", "8000", "--max-num-seqs", "64", "--max-num-batched-tokens=4096",
         "--no-enable-prefix-caching", "--prefix-cache-size", "0"], environ={})
    want = ServerConfig(model_id="Qwen/Qwen3-Embedding-0.6B", model_task="embed", max_input_length=512,
                        served_model_name="qwen,emb", api_key="k3y", hostname="127.0.0.1", port=8000,
                        max_batch_requests=64, max_batch_tokens=4096, prefix_cache_size="0")
    assert config == want
    assert config.model_name == "qwen" and config.model_names == ("qwen", "emb")
    assert any("--trust-remote-code" in n and "no effect" in n for n in notes)


@pytest.mark.parametrize("line,task", [(["--task", "score"], "score"), (["--convert", "classify"], "classify"),
                                       (["--task", "reward"], "reward"), (["--runner", "pooling"], None),
                                       (["--task=embedding"], "embed"), (["--dtype", "half"], None)])
def test_vllm_tasks(line, task):
    config, _ = load_config(["serve", "/m", *line], environ={})
    assert config.model_task == task and config.model_id == "/m"


def test_an_infinity_line_maps_to_our_flags():
    config, notes = load_config(
        ["v2", "--model-id", "BAAI/bge-reranker", "--batch-size", "32", "--url-prefix", "/v1", "--engine", "torch",
         "--device", "cpu", "--port", "7997", "--host", "0.0.0.0", "--no-bettertransformer"], environ={})
    assert config == ServerConfig(model_id="BAAI/bge-reranker", max_batch_requests=32, device="cpu", port=7997,
                                  hostname="0.0.0.0", url_prefix="/v1")
    assert {n.split(" accepted")[0] for n in notes} >= {"Infinity's --engine"}


@pytest.mark.parametrize("line,prefix", [([], "/"), (["--url-prefix", ""], "/"), (["--url-prefix", "/v1/"], "/v1"),
                                         (["--url-prefix=/api/emb"], "/api/emb")])
def test_infinitys_url_prefix_is_its_routes_prefix_and_the_root_by_default(line, prefix):
    config, _ = load_config(["v2", "--model-id", "m", *line], environ={})
    assert config.url_prefix == prefix
    assert load_config(["--model-id", "m"], environ={})[0].url_prefix is None  # ours: Infinity's at /infinity


@pytest.mark.parametrize("argv,needles", [
    (["serve", "/m", "--gpu-memory-utilization", "0.9"], ["--prefix-cache-size"]),
    (["--gpu-memory-utilization=0.5"], ["--prefix-cache-size"]),
    (["serve", "/m", "--tensor-parallel-size", "2"], ["--device cuda:N"]),
    (["serve", "/m", "--task", "generate"], ["embed", "score"]),
    (["serve", "/m", "--dtype", "int8"], ["bfloat16"]),
    (["serve", "/m", "--quantization", "awq"], ["--dtype"]),
    (["serve", "/m", "--made-up", "1"], ["not a vLLM flag", "--max-model-len", "radixserve --help"]),
    (["serve"], ["needs the model"]),
    (["serve", "/m", "/n"], ["give the model once"]),
    (["v2", "--model-id", "a", "--model-id", "b"], ["one model"]),
    (["v2", "--model-id", "a", "--engine", "optimum"], ["--engine torch"]),
    (["v2", "--model-id", "a", "--url-prefix", "api/"], ["--url-prefix 'api'", "/v1"]),
    (["--url-prefix", "/v1?x"], ["--url-prefix '/v1?x'", "no trailing slash"]),
    (["v2", "--model-id", "a", "--device-id", "1"], ["--device cuda:N"]),
    (["--max-model-len", "512"], ["--max-input-length"]),
    (["--mod", "x"], ["unrecognized arguments: --mod", "radixserve serve MODEL"]),  # no abbreviations
    (["--hostn", "x"], ["unrecognized arguments: --hostn"]),
])
def test_refusals_name_our_flag(argv, needles, capsys):
    err = _refusal(argv, capsys)
    for needle in needles:
        assert needle in err, err


def test_the_aliases_users_type_are_spelled_out():
    config, _ = load_config(["--model", "/m", "--host", "127.0.0.1"], environ={})
    assert config.model_id == "/m" and config.hostname == "127.0.0.1"


def test_flags_are_checked_before_torch_is_imported():
    """A bad line returns from main() with torch (and the model code) never imported."""
    code = ("import sys\nfrom server import cli\n"
            "for argv in (['serve', '/m', '--gpu-memory-utilization', '0.9'], ['--prefix-cache-size', 'lots'],"
            " ['v2', '--model-id', 'x', '--engine', 'neuron'], ['--port', 'x']):\n"
            "    try:\n        cli.main(argv)\n    except SystemExit as e:\n        assert e.code == 2, e.code\n"
            "    else:\n        raise AssertionError(argv)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'models')"
            " and m not in ('models.options', 'models', 'models.startup')))")  # startup: the torch-free clock
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_a_task_the_checkpoint_cannot_serve_is_refused_at_start(tiny_reranker_dir):
    out = subprocess.run([sys.executable, "-m", "server.cli", "serve", str(tiny_reranker_dir), "--task", "embed",
                          "--port", "0", "--host", "127.0.0.1"],
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "--task) embed needs an embedding model" in out.stdout + out.stderr
    assert "give score" in out.stdout + out.stderr


@pytest.mark.parametrize("task,kind,ok", [("embed", "embedding", True), ("score", "reranker", True),
                                          ("classify", "classifier", True), ("reward", "reward", True),
                                          ("classify", "embedding", False), ("score", "classifier", False),
                                          (None, "reranker", True)])
def test_check_kind(task, kind, ok):
    config = ServerConfig(model_task=task)
    if ok:
        config.check_kind(kind)
    else:
        with pytest.raises(ValueError, match="needs an? (classifier|reranker) model"):
            config.check_kind(kind)


@pytest.mark.parametrize("task,load", [("embed", None), ("score", None), ("classify", "classifier"),
                                       ("reward", "reward"), (None, None)])
def test_classify_and_reward_choose_the_heads_kind_at_load(task, load):
    # a one-label score head serves as a reranker by default; vLLM's task picks classifier or reward
    assert ServerConfig(model_task=task).load_kind == load
