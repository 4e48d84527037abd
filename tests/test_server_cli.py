"""The radixserve CLI: flags, env vars and their precedence, TEI's flags, refused values, JSON logs.
Real processes (start-up line, drain on SIGTERM) are in test_server_lifecycle.py."""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys

import pytest

from server import cli as server_cli
from server.cli import export_hub_settings, load_config, parse_config
from server.config import DEFAULT_MODEL_ID, ServerConfig
from server.http.logs import JsonFormatter



def test_defaults_match_api_md():
    c = parse_config([], environ={})
    assert c == ServerConfig()
    assert (c.model_id, c.port, c.hostname, c.max_batch_tokens) == (DEFAULT_MODEL_ID, 8080, "0.0.0.0", 16384)
    assert (c.max_concurrent_requests, c.max_client_batch_size, c.payload_limit) == (4096, 2048, 2_000_000)
    assert c.auto_truncate is True and c.radix_mlp_threshold == 0.95 and c.radix_attention == "compact"
    assert c.api_key is None and c.prometheus_port is None and c.cors_allow_origin is None
    assert 0 < c.graceful_shutdown_timeout < 30  # drains inside Kubernetes' default 30 s grace


def test_flags_env_and_precedence():
    env = {"MAX_BATCH_TOKENS": "2048", "API_KEY": "k", "AUTO_TRUNCATE": "false", "PORT": "9000", "JSON_OUTPUT": "1"}
    c = parse_config(["--port", "9100", "--radix-attention", "paper", "--max-batch-requests", "8"], environ=env)
    assert (c.max_batch_tokens, c.api_key, c.auto_truncate, c.port, c.json_output) == (2048, "k", False, 9100, True)
    assert c.radix_attention == "paper" and c.max_batch_requests == 8
    c = parse_config(["--auto-truncate", "true", "--json-output"], environ=env)
    assert c.auto_truncate is True and c.json_output is True
    c = parse_config(["--json-output", "false"], environ=env)
    assert c.json_output is False
    assert parse_config([], environ={}).cpu_packed_weights is True
    assert parse_config(["--cpu-packed-weights", "false"], environ={}).cpu_packed_weights is False


def test_cpu_packed_weights_flag_reaches_the_runner(tiny_embedding_dir):
    from server.app import load_runner

    argv = ["--model-id", str(tiny_embedding_dir), "--prefix-cache-size", "0"]
    served = load_runner(parse_config(argv, environ={}))
    assert served.report.linear == "onednn-packed"
    # serving keeps one copy: the dense linear weights are freed once packed
    assert all(m.weight.numel() == 0 for m in served.model.modules() if hasattr(m, "dense_dropped"))
    off = parse_config(argv + ["--cpu-packed-weights", "false"], environ={})
    assert load_runner(off).report.linear == "F.linear"


def test_tree_attention_flag_reaches_the_runner(tiny_embedding_dir):
    from server.app import load_runner

    argv = ["--model-id", str(tiny_embedding_dir), "--prefix-cache-size", "0"]
    assert parse_config(argv, environ={}).tree_attention == "auto"
    assert parse_config(argv, environ={"TREE_ATTENTION": "on"}).tree_attention == "on"
    off = load_runner(parse_config(argv + ["--tree-attention", "off"], environ={"TREE_ATTENTION": "on"}))
    assert (off.tree_attention, off.tree_report) == ("off", "off")
    on = load_runner(parse_config(argv, environ={"TREE_ATTENTION": "on"}))
    assert on.tree_attention == "on" and on.tree_report.startswith(("on (", "off ("))


def test_max_rerank_pair_tokens_flag():
    assert parse_config([], environ={}).max_rerank_pair_tokens == 1_048_576
    assert parse_config(["--max-rerank-pair-tokens", "0"], environ={}).max_rerank_pair_tokens == 0
    assert parse_config([], environ={"MAX_RERANK_PAIR_TOKENS": "4096"}).max_rerank_pair_tokens == 4096


@pytest.mark.parametrize("argv", [
    ["--auto-truncate", "maybe"],
    ["--max-batch-tokens", "many"],
    ["--max-batch-tokens", "0"],
    ["--radix-attention", "fast"],
    ["--tree-attention", "always"],
    ["--max-rerank-pair-tokens", "-1"],
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


def _exit_message(argv, environ, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        parse_config(argv, environ=environ)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("value", ["none", "None", "NONE", "null", "Null", "", "   ", " none ", "nil"])
def test_api_key_that_looks_like_no_key_is_refused(value, capsys):
    for argv, env in ((["--api-key", value], {}), ([], {"API_KEY": value})):
        message = _exit_message(argv, env, capsys)
        assert "refusing --api-key/API_KEY" in message and "leave both --api-key and API_KEY unset" in message


def test_api_key_absent_means_no_auth_and_real_keys_are_kept():
    assert parse_config([], environ={}).api_key is None
    assert parse_config(["--api-key", "none-shall-pass"], environ={}).api_key == "none-shall-pass"
    assert parse_config([], environ={"API_KEY": "s3cr3t"}).api_key == "s3cr3t"
    c = parse_config(["--api-key", "clé-ü"], environ={"API_KEY": "other"})
    assert c.api_key == "clé-ü"
    assert "clé" not in repr(c)  # secrets stay out of logs


def test_permits_must_admit_the_largest_request(capsys):
    message = _exit_message(["--max-concurrent-requests", "100", "--max-client-batch-size", "2048"], {}, capsys)
    assert "--max-concurrent-requests (100) is smaller than --max-client-batch-size (2048)" in message
    message = _exit_message([], {"MAX_CLIENT_BATCH_SIZE": "9000"}, capsys)
    assert "could never be admitted" in message
    message = _exit_message(["--max-concurrent-requests", "100"], {"MAX_CLIENT_BATCH_SIZE": "101"}, capsys)
    assert "--max-concurrent-requests (100) is smaller than --max-client-batch-size (101)" in message
    c = parse_config(["--max-concurrent-requests", "100", "--max-client-batch-size", "100"], environ={})
    assert (c.max_concurrent_requests, c.max_client_batch_size) == (100, 100)


@pytest.mark.parametrize("argv,env", [
    (["--max-concurrent-requests", "512"], {}),
    ([], {"MAX_CONCURRENT_REQUESTS": "512"}),
])
def test_permits_alone_set_the_client_batch_size(argv, env):
    """TEI's launch lines give 512 permits and no client batch size: the largest request is 512."""
    config, notes = load_config(argv, environ=env)
    assert (config.max_concurrent_requests, config.max_client_batch_size) == (512, 512)
    assert any("--max-client-batch-size set to 512" in n for n in notes)
    config, notes = load_config(["--max-concurrent-requests", "3000"], environ={})
    assert (config.max_concurrent_requests, config.max_client_batch_size) == (3000, 2048)
    assert not any("--max-client-batch-size" in n for n in notes)
    config, notes = load_config(["--max-concurrent-requests", "512", "--max-client-batch-size", "8"], environ={})
    assert config.max_client_batch_size == 8 and not any("--max-client-batch-size" in n for n in notes)


@pytest.mark.parametrize("argv", [["--device-id", "0"], ["--device-id=1", "--port", "80"]])
def test_infinitys_device_id_points_to_device(argv, capsys):
    message = _exit_message(argv, {}, capsys)
    assert "--device-id is Infinity's flag" in message and "--device cuda:N" in message


def test_revision_of_a_local_directory_is_ignored_with_a_warning(tmp_path):
    config, notes = load_config(["--model-id", str(tmp_path), "--revision", "v2"], environ={})
    assert config.revision == "v2"
    assert [n for n in notes if "--revision" in n] == [
        f"--revision 'v2' is ignored: --model-id {str(tmp_path)!r} is a local directory, served as it is"]
    _, notes = load_config(["--model-id", "Qwen/Qwen3-Embedding-0.6B", "--revision", "v2"], environ={})
    assert not any("--revision" in n for n in notes)
    _, notes = load_config(["--model-id", str(tmp_path)], environ={})
    assert not any("--revision" in n for n in notes)


@pytest.mark.parametrize("argv,needle", [
    (["--dtype", "float8"], "--dtype must be one of float32, float16, bfloat16"),
    (["--pooling", "splade"], "--pooling must be one of last-token, mean, cls"),
    (["--batching-policy", "lifo"], "--batching-policy must be one of fifo, prefix"),
    (["--graceful-shutdown-timeout", "-1"], "--graceful-shutdown-timeout must be >= 0"),
    (["--header-read-timeout", "0"], "--header-read-timeout must be >= 0.001"),
    (["--hf-token", "a", "--hf-api-token", "b"], "not both"),
])
def test_choices_and_bounds_come_from_the_field_metadata(argv, needle, capsys):
    assert needle in _exit_message(argv, {}, capsys)


def test_help_is_generated_from_the_fields(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--help"], environ={})
    text = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(ServerConfig):
        assert f"--{f.name.replace('_', '-')}" in text and f"env {f.name.upper()};" in text, f.name
        assert f.metadata["help"].split()[0] in text
    assert "-p PORT, --port PORT" in text and "(compact | paper)" in text
    assert not hasattr(server_cli, "_HELP")


TEI_LAUNCH = (
    "--model-id Qwen/Qwen3-Embedding-0.6B --revision main -p 3000 --hostname 0.0.0.0 "
    "--max-concurrent-requests 512 --max-batch-tokens 16384 --max-batch-requests 64 "
    "--max-client-batch-size 32 --auto-truncate --tokenization-workers 2 --prometheus-port 9000 "
    "--json-output --disable-spans --dtype float16 --pooling last-token --payload-limit 2000000 "
    "--hf-token hf_abc --huggingface-hub-cache /data --cors-allow-origin https://a.example "
    "--cors-allow-origin https://b.example,https://c.example --uds-path /tmp/tei-server "
    "--otlp-endpoint http://otel:4317 --otlp-service-name text-embeddings-inference.server "
    "--served-model-name qwen3-embed --default-prompt-name query --api-key sk-local --dense-path 2_Dense"
)


def test_a_tei_launch_line_parses_with_teis_meaning():
    config, notes = load_config(TEI_LAUNCH.split(), environ={"HOSTNAME": "3f2a9c1b7e4d"})
    assert (config.port, config.hostname, config.revision) == (3000, "0.0.0.0", "main")
    assert (config.max_concurrent_requests, config.max_batch_requests, config.max_client_batch_size) == (512, 64, 32)
    assert config.auto_truncate is True and config.json_output is True and config.tokenization_workers == 2
    assert (config.prometheus_port, config.dtype, config.pooling) == (9000, "float16", "last-token")
    assert config.hub_token == "hf_abc" and config.huggingface_hub_cache == "/data"
    assert config.cors_allow_origin == ("https://a.example", "https://b.example", "https://c.example")
    assert (config.uds_path, config.otlp_endpoint) == ("/tmp/tei-server", "http://otel:4317")
    assert (config.model_name, config.default_prompt_name, config.api_key) == ("qwen3-embed", "query", "sk-local")
    joined = "\n".join(notes)
    assert "--disable-spans has no effect" in joined and "--dense-path has no effect" not in joined
    assert config.dense_path == "2_Dense"
    assert "ignoring HOSTNAME='3f2a9c1b7e4d'" in joined


def test_tei_env_names_and_the_deprecated_token():
    env = {"HF_TOKEN": "hf_new", "HUGGINGFACE_HUB_CACHE": "/cache", "PROMETHEUS_PORT": "9100",
           "TOKENIZATION_WORKERS": "3", "CORS_ALLOW_ORIGIN": "*", "OTLP_SERVICE_NAME": "svc"}
    c = parse_config([], environ=env)
    assert (c.hub_token, c.huggingface_hub_cache, c.prometheus_port) == ("hf_new", "/cache", 9100)
    assert (c.tokenization_workers, c.cors_allow_origin, c.otlp_service_name) == (3, ("*",), "svc")
    config, notes = load_config([], environ={"HF_API_TOKEN": "hf_old", "HF_TOKEN": ""})
    assert config.hub_token == "hf_old" and any("deprecated" in n for n in notes)


@pytest.mark.parametrize("env,argv,expected,ignored", [
    ({"HOSTNAME": "3f2a9c1b7e4d"}, [], "0.0.0.0", True),  # Docker: the container id
    ({"HOSTNAME": "radixserve-7d9f8-abcde"}, [], "0.0.0.0", True),  # Kubernetes: the pod name
    ({"HOSTNAME": "127.0.0.1"}, [], "127.0.0.1", False),
    ({"HOSTNAME": "::"}, [], "::", False),
    ({"HOSTNAME": "3f2a9c1b7e4d"}, ["--hostname", "my-host.local"], "my-host.local", True),
])
def test_hostname_env_is_not_a_footgun(env, argv, expected, ignored):
    config, notes = load_config(argv, environ=env)
    assert config.hostname == expected
    assert any("ignoring HOSTNAME" in n for n in notes) is ignored


def test_export_hub_settings():
    env: dict[str, str] = {}
    export_hub_settings(parse_config(["--hf-token", "hf_x", "--huggingface-hub-cache", "/hub"], environ={}), env)
    assert env == {"HF_TOKEN": "hf_x", "HF_HUB_CACHE": "/hub", "HUGGINGFACE_HUB_CACHE": "/hub"}


def test_otlp_without_its_packages_starts_and_says_so(monkeypatch, caplog):
    from server.http import tracing

    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # import fails as if not installed
    app = object()
    with caplog.at_level(logging.WARNING, logger="radixserve.server"):
        assert tracing.instrument(app, endpoint="http://otel:4317", service_name="s") is app
    assert "tracing is off" in caplog.text and "radixserve[otlp]" in caplog.text
    assert tracing.instrument(app, endpoint=None, service_name="s") is app


def test_the_switch_interval_is_set_at_start_and_logged(caplog):
    from server import process as cli

    before = sys.getswitchinterval()
    caplog.set_level(logging.INFO, logger=cli.log.name)
    try:
        cli.tune_switch_interval()
        assert sys.getswitchinterval() == pytest.approx(cli.SWITCH_INTERVAL_S)
    finally:
        sys.setswitchinterval(before)
    (line,) = [r.getMessage() for r in caplog.records if "switch interval" in r.getMessage()]
    assert f"{cli.SWITCH_INTERVAL_S * 1e3:.2f} ms" in line and f"default {before * 1e3:.2f} ms" in line


def test_start_up_objects_are_frozen_out_of_garbage_collection(caplog):
    import gc

    from server import process

    caplog.set_level(logging.INFO, logger=process.log.name)
    try:
        process.freeze_startup_objects()
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # this test process's modules and objects at least
    finally:
        gc.unfreeze()
    (line,) = [r.getMessage() for r in caplog.records if "out of garbage collection" in r.getMessage()]
    logged = int(re.match(r"froze (\d+) start-up objects", line).group(1))
    # Frozen objects that die (other tests' threads still freeing theirs) leave the permanent
    # generation between the log line and the read above; nothing else adds to it.
    assert frozen <= logged <= frozen + frozen // 100
