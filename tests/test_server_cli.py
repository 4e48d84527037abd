"""The radixserve CLI: flags, env vars and their precedence, JSON logs, and a real process that
serves, logs its start-up line and shuts down gracefully on SIGTERM."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server.cli import parse_config
from server.config import DEFAULT_MODEL_ID, ServerConfig
from server.logs import JsonFormatter
from server.testing import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_match_api_md():
    c = parse_config([], environ={})
    assert c == ServerConfig()
    assert (c.model_id, c.port, c.hostname, c.max_batch_tokens) == (DEFAULT_MODEL_ID, 8080, "0.0.0.0", 16384)
    assert (c.max_concurrent_requests, c.max_client_batch_size, c.payload_limit) == (512, 64, 2_000_000)
    assert c.auto_truncate is True and c.radix_mlp_threshold == 0.95 and c.radix_attention == "compact"


def test_flags_env_and_precedence():
    env = {"MAX_BATCH_TOKENS": "2048", "API_KEY": "k", "AUTO_TRUNCATE": "false", "PORT": "9000", "JSON_OUTPUT": "1"}
    c = parse_config(["--port", "9100", "--radix-attention", "paper", "--max-batch-requests", "8"], environ=env)
    assert (c.max_batch_tokens, c.api_key, c.auto_truncate, c.port, c.json_output) == (2048, "k", False, 9100, True)
    assert c.radix_attention == "paper" and c.max_batch_requests == 8
    c = parse_config(["--auto-truncate", "true", "--json-output"], environ=env)
    assert c.auto_truncate is True and c.json_output is True
    c = parse_config(["--json-output", "false"], environ=env)
    assert c.json_output is False


@pytest.mark.parametrize("argv", [
    ["--auto-truncate", "maybe"],
    ["--max-batch-tokens", "many"],
    ["--max-batch-tokens", "0"],
    ["--radix-attention", "fast"],
    ["--radix-mlp-threshold", "1.5"],
    ["--default-prompt", "x", "--default-prompt-name", "query"],
])
def test_bad_flags_exit(argv):
    with pytest.raises(SystemExit) as info:
        parse_config(argv, environ={})
    assert info.value.code == 2


def test_json_formatter():
    record = logging.LogRecord("radixserve.server", logging.INFO, __file__, 1, "hello %s", ("world",), None)
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "hello world" and line["level"] == "INFO" and line["target"] == "radixserve.server"


def test_process_serves_and_drains_on_sigterm(tiny_embedding_dir):
    port = free_port()
    env = dict(os.environ, RADIX_MLP_THRESHOLD="1.0", MAX_CLIENT_BATCH_SIZE="7", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "server.cli", "--model-id", str(tiny_embedding_dir), "--hostname", "127.0.0.1",
           "--port", str(port), "--json-output", "--max-batch-tokens", "512"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        info = httpx.get(url + "/info").json()
        assert info["max_client_batch_size"] == 7 and info["radix_mlp_threshold"] == 1.0
        assert info["max_batch_tokens"] == 512 and info["max_input_length"] == 512
        assert httpx.post(url + "/embed", json={"inputs": ["a", "b"]}, timeout=30).status_code == 200
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # NOTE: uvicorn re-raises the caught signal after its graceful shutdown (exit by SIGTERM).
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Application shutdown complete." in out
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    messages = [line["message"] for line in lines]
    start = next(m for m in messages if m.startswith("radixserve serving"))
    for part in ("kind=embedding", "device=cpu", "dtype=float32", "attention_backend=", "kernels=",
                 "radix_mlp_threshold=1.0", "radix_attention=compact"):
        assert part in start, start
    assert any("draining" in m for m in messages)
