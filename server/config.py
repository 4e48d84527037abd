"""Server configuration: one frozen dataclass whose fields are the CLI flags, each defined once.

A field's metadata (``option(...)``) carries its help text, choices, short flag, env variable and
whether it is a secret; argparse, env parsing, choice validation and ``--help`` are generated from
it (server/cli.py). Every flag also reads an environment variable, the field name in upper snake
case (``max_batch_tokens`` -> MAX_BATCH_TOKENS); command line beats env beats default. The
environment is read in exactly one place, ``env_values``.

NOTE: HOSTNAME is the env twin of --hostname, and Docker and Kubernetes set it to the container
or pod name. Like TEI (which falls back to 0.0.0.0 when HOSTNAME is not an IP address), a HOSTNAME
that is not an IP address literal is ignored with a warning; --hostname on the command line may be
any name.
"""
from __future__ import annotations

import functools
import ipaddress
import os
import re
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Mapping

from models.options import POOLINGS, RADIX_ATTENTION, TREE_ATTENTION, check_radix_mlp_threshold, parse_cache_size

DEFAULT_MODEL_ID = "Qwen/Qwen3-Embedding-0.6B"

# Values that mean "no key" to a human. An API key that looks like one of them is refused at start:
# `--api-key none` must never silently turn authentication off.
_URL_PREFIX = re.compile(r"/|(/[A-Za-z0-9._~-]+)+")


def check_url_prefix(prefix: str | None) -> None:
    """--url-prefix: / or /segment[/segment...] of URL-safe characters, no trailing slash."""
    if prefix is not None and not _URL_PREFIX.fullmatch(prefix):
        raise ValueError(f"--url-prefix {prefix!r}: give / (the root) or a path such as /v1 (no trailing slash)")


_NO_KEY = frozenset({"", "none", "null", "nil", "false", "no", "off", "0"})

# vLLM's pooling tasks -> the model kind that serves them here (a reranker's head gives the score).
TASK_KINDS = {"embed": "embedding", "classify": "classifier", "score": "reranker", "reward": "reward"}
# Tasks that choose the head's kind at load (a one-label score head serves either, models.families.registry).
LOAD_KIND_TASKS = ("classify", "reward")
TASKS = tuple(TASK_KINDS)


def option(default, help: str, *, choices: tuple[str, ...] = (), short: str | None = None,
           secret: bool = False, minimum: float | None = None, inert: str | None = None,
           aliases: tuple[str, ...] = ()):
    """A config field with its CLI metadata.

    ``inert``: why the flag is accepted (TEI compatibility) but has no effect here; setting it
    logs that reason at start. ``secret``: kept out of repr and the start-up log. ``aliases``: other
    spellings users type (the parser takes no abbreviations, so each is spelled out).
    """
    meta = {"help": help, "choices": choices, "short": short, "secret": secret, "minimum": minimum, "inert": inert,
            "aliases": aliases}
    return field(default=default, repr=not secret, metadata=meta)


@dataclass(frozen=True)
class ServerConfig:
    """What ``radixserve`` was asked to serve, and with which limits."""

    model_id: str = option(DEFAULT_MODEL_ID, "hub id (downloaded and cached) or local checkpoint directory",
                           aliases=("--model",))
    revision: str | None = option(None, "hub revision (branch, tag or commit)")
    served_model_name: str | None = option(
        None, "name reported by /info and the /v1 routes (default: the model id); comma-separated: the first is "
              "reported, each is accepted as a request's model")
    model_task: str | None = option(
        None, "what the model must serve (vLLM's --task, --runner, --convert): embed (an embedding model), or classify, score or "
              "reward (a reranker's score head); a checkpoint of the other kind is refused at start",
        choices=TASKS)
    hostname: str = option("0.0.0.0", "listen address (a HOSTNAME variable that is not an IP address is ignored)",
                           aliases=("--host",))
    port: int = option(8080, "listen port", short="-p", minimum=0)
    uds_path: str | None = option(None, "also serve the HTTP API on this unix domain socket")
    api_server_count: int = option(
        1, "processes serving the HTTP API (vLLM's flag): above 1, this many front-end processes parse, validate, "
           "tokenize and render, and hand token ids to this process, which runs the model", minimum=1)
    device: str | None = option(None, "cuda, cuda:N or cpu (default: cuda if available)")
    dtype: str | None = option(None, "default: bfloat16 on cuda, float32 on cpu",
                               choices=("float32", "float16", "bfloat16"))
    max_batch_tokens: int = option(16384, "token budget of one forward", minimum=1)
    max_batch_requests: int | None = option(None, "cap on items per forward", minimum=1)
    max_concurrent_requests: int = option(
        4096, "permits, one per input item; none left: immediate 429 (must be >= --max-client-batch-size; "
        "when that is not given, it follows the permits below 2048)", minimum=1)
    max_client_batch_size: int = option(2048, "inputs per HTTP request", minimum=1)
    max_embed_all_floats: int = option(
        4_194_304, "floats one /embed_all answer may hold (its tokens x the hidden size); more: 422", minimum=1)
    max_rerank_pair_tokens: int = option(
        1_048_576, "tokens of one rerank request's query-document pairs together; more: 422 (0: no limit)",
        minimum=0)
    max_input_length: int | None = option(None, "tokens per input (default: the model's max positions)", minimum=1)
    auto_truncate: bool = option(True, "truncate over-long inputs when a request does not say")
    tokenization_workers: int | None = option(
        None, "threads that tokenize requests (default: CPU cores - 1, at least 2, at most 64)", minimum=1)
    radix_mlp_threshold: float = option(
        0.95, "use the prefix trie iff compact/original < threshold and it saves enough work to pay for "
              "itself; 1 always; 0 never")
    radix_attention: str = option("compact", "attention over the compact rows", choices=RADIX_ATTENTION)
    tree_attention: str = option(
        "auto", "tree attention along the prefix trie (a shared prefix's K/V read once per layer): auto "
                "where estimated cheaper than the flat path on the CPU (flat on CUDA, where it measured "
                "slower), on for every compact batch, off never",
        choices=TREE_ATTENTION)
    cuda_graphs: str = option(
        "auto", "a lone short input through a CUDA graph captured at start-up per length bucket: auto where "
                "it measures faster than eager (checked exact first; off on a CPU), on for every bucket that "
                "checks exact (refused without CUDA), off never",
        choices=("auto", "on", "off"))
    batching_policy: str = option(
        "fifo", "fifo, or prefix: form batches from requests that share prefixes (with aging)",
        choices=("fifo", "prefix"))
    batching_max_wait_ms: float = option(500.0, "prefix policy: a request waiting this long goes first", minimum=0)
    batching_max_skips: int = option(2, "prefix policy: a request passed over this many times goes first", minimum=0)
    pooling: str | None = option(None, "default: from the checkpoint", choices=POOLINGS)
    default_prompt_name: str | None = option(None, "embedding prompt name (a key of the model's prompts)")
    default_prompt: str | None = option(None, "embedding prompt text prepended to every input")
    url_prefix: str | None = option(
        None, "Infinity's --url-prefix: its routes (rerank, models, embeddings) with Infinity's answers at PREFIX/...; "
              "/ puts them at the root (/rerank answers a documents body as Infinity does); unset: at /infinity")
    allow_token_ids: bool = option(
        False, "accept token ids as /v1/embeddings input, read as this model's tokenizer's ids (off: 422 naming "
               "the fix, since LangChain's OpenAIEmbeddings sends tiktoken's ids by default)")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on inference routes (unset: no auth)",
                                 secret=True)
    payload_limit: int = option(2_000_000, "bytes per request body", minimum=1)
    memory_limit: int | None = option(
        None, "bytes the process may use (default: the cgroup or ulimit -v limit); requests that cannot fit: "
        "413", minimum=1)
    graceful_shutdown_timeout: float = option(
        25.0, "seconds from SIGTERM to exit: in-flight work may finish, then what is left gets a JSON 503",
        minimum=0)
    header_read_timeout: float = option(
        10.0, "seconds a connection may take to send a complete request head (slow clients are closed)",
        minimum=0.001)
    body_read_timeout: float = option(30.0, "seconds a request may take to send its body (then 408)", minimum=0.001)
    cors_allow_origin: tuple[str, ...] | None = option(
        None, "origins allowed by CORS (comma-separated or repeated; * for any; unset: no CORS headers)")
    prometheus_port: int | None = option(
        None, "also serve the metrics on their own listener on this port (TEI: 9000; /metrics stays)", minimum=0)
    prometheus_hostname: str | None = option(
        None, "address of the --prometheus-port listener (default: --hostname)")
    http_stack: str = option(
        "auto", "HTTP parser and event loop: httptools on uvloop, or h11 on asyncio; auto: httptools when installed",
        choices=("auto", "httptools", "h11"))
    max_connections: int | None = option(
        None, "open connections (default and ceiling: the open-file limit less a reserve); beyond it the "
              "oldest idle connection is closed", minimum=1)
    compute_tokens_header: bool = option(
        True, "send x-compute-tokens (it reveals how much of an input other requests had cached: see the "
              "security notes)")
    json_output: bool = option(False, "JSON log lines")
    disable_spans: bool = option(False, "TEI: drop span fields from log lines",
                                 inert="log lines here carry no spans")
    otlp_endpoint: str | None = option(None, "OpenTelemetry OTLP/gRPC endpoint for request traces, e.g. http://localhost:4317")
    otlp_service_name: str = option("radixserve.server", "OpenTelemetry service name")
    hf_token: str | None = option(None, "Hugging Face Hub token (gated or private models)", secret=True)
    hf_api_token: str | None = option(None, "deprecated TEI spelling of --hf-token", secret=True)
    huggingface_hub_cache: str | None = option(None, "Hugging Face Hub cache directory (default: HF_HOME/hub)")
    dense_path: str | None = option(
        None, "TEI: the folder of the sentence-transformers Dense module applied after pooling (replaces the one "
              "modules.json names; without modules.json, adds it)")
    rerank_template: str | None = option(
        None, "serve a one-label score head or a causal LM as a reranker through this template (default: the one "
              "its family publishes, if any)", choices=("qwen3-reranker", "bge-reranker-gemma"))
    prefix_cache_size: str = option(
        "auto", "cross-batch K/V cache of shared prefixes: 512MiB, 2GB, 8192tokens, a byte count, auto or 0 (off)")
    cpu_packed_weights: bool = option(
        True, "on a CPU in float32, run linears through oneDNN with weights packed at load "
              "(faster small batches)")
    cpu_weights: str = option(
        "fp32", "on a CPU in float32, the linear weights' precision: int8 and bf16 trade accuracy for speed "
                "(the kernel is measured at load)", choices=("fp32", "int8", "bf16"))

    def __post_init__(self) -> None:
        hints = field_types()
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if value is None:
                continue
            if meta["choices"] and value not in meta["choices"]:
                raise ValueError(f"{flag_name(f.name)} must be one of {', '.join(meta['choices'])}, not {value!r}")
            if meta["minimum"] is not None and hints[f.name] in (int, float) and value < meta["minimum"]:
                raise ValueError(f"{flag_name(f.name)} must be >= {meta['minimum']:g}, got {value}")
        if self.default_prompt_name is not None and self.default_prompt is not None:
            raise ValueError("give --default-prompt-name or --default-prompt, not both")
        if self.hf_token is not None and self.hf_api_token is not None:
            raise ValueError("give --hf-token or the deprecated --hf-api-token, not both")
        check_radix_mlp_threshold(self.radix_mlp_threshold, flag_name("radix_mlp_threshold"))
        if self.api_key is not None and self.api_key.strip().lower() in _NO_KEY:
            raise ValueError(
                f"refusing --api-key/API_KEY {self.api_key!r}: it looks like 'no key'. To run without "
                "authentication leave both --api-key and API_KEY unset; otherwise give a real key")
        if self.max_concurrent_requests < self.max_client_batch_size:
            raise ValueError(
                f"--max-concurrent-requests ({self.max_concurrent_requests}) is smaller than "
                f"--max-client-batch-size ({self.max_client_batch_size}): a request with that many inputs "
                "could never be admitted. Raise --max-concurrent-requests or lower --max-client-batch-size")
        check_url_prefix(self.url_prefix)
        parse_cache_size(self.prefix_cache_size)  # raises on a malformed size (no torch import: flags come first)

    @property
    def model_name(self) -> str:
        """The name reported by /info and the /v1 routes."""
        return self.model_names[0]

    @property
    def model_names(self) -> tuple[str, ...]:
        """The served names (the first is reported), else the model id."""
        return self.served_names or (self.model_id,)

    @property
    def served_names(self) -> tuple[str, ...]:
        """--served-model-name's names; empty when it was not given (then any request ``model`` is served)."""
        return tuple(n.strip() for n in (self.served_model_name or "").split(",") if n.strip())

    def check_kind(self, kind: str) -> None:
        """Refuse a checkpoint whose kind cannot serve ``--model-task`` (known only once it is loaded)."""
        if self.model_task is not None and TASK_KINDS[self.model_task] != kind:
            want = TASK_KINDS[self.model_task]
            fits = {v: k for k, v in TASK_KINDS.items()}.get(kind, "embed")
            raise ValueError(
                f"--model-task (vLLM's --task) {self.model_task} needs {'an' if want == 'embedding' else 'a'} "
                f"{want} model, but {self.model_id} is {'an' if kind == 'embedding' else 'a'} {kind}: give "
                f"{fits}, or leave it out")

    @property
    def load_kind(self) -> str | None:
        """The head kind to load the checkpoint as, where ``--model-task`` chooses it."""
        return TASK_KINDS[self.model_task] if self.model_task in LOAD_KIND_TASKS else None

    @property
    def hub_token(self) -> str | None:
        return self.hf_token or self.hf_api_token

    def inert_flags(self) -> list[str]:
        """One warning per flag that was set but has no effect here."""
        return [
            f"{flag_name(f.name)} has no effect in radixserve: {f.metadata['inert']}"
            for f in fields(self)
            if f.metadata["inert"] and getattr(self, f.name) != f.default
        ]


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_var(name: str) -> str:
    """The environment variable of a field: ``max_batch_tokens`` -> ``MAX_BATCH_TOKENS``."""
    return name.upper()


def parse_bool(text: str) -> bool:
    """true/false (also 1/0, yes/no, on/off), case-insensitive."""
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


@functools.lru_cache(maxsize=1)
def field_types() -> dict[str, type]:
    """Field name -> the scalar type its text converts to (Optional stripped; tuple[str, ...] -> tuple)."""
    out: dict[str, type] = {}
    for name, hint in typing.get_type_hints(ServerConfig).items():
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        out[name] = tuple if typing.get_origin(hint) is tuple else hint
    return out


def is_secret(name: str) -> bool:
    return next(f for f in fields(ServerConfig) if f.name == name).metadata["secret"]


def convert(name: str, text: str | list[str]) -> Any:
    """A flag's or variable's text -> the field's value.

    "none"/"" clear optional fields, except secrets: a secret keeps its text as given so that
    ``--api-key none`` is refused rather than read as "no key".
    """
    kind = field_types()[name]
    if kind is tuple:  # repeated flag and/or comma-separated
        parts = [p.strip() for t in ([text] if isinstance(text, str) else text) for p in t.split(",")]
        parts = [p for p in parts if p]
        return tuple(parts) or None
    assert isinstance(text, str), f"{name} takes one value"
    if kind is bool:
        return parse_bool(text)
    if is_secret(name):
        return text
    if text.strip().lower() in ("", "none") and _optional(name):
        return None
    return kind(text)


def _optional(name: str) -> bool:
    f = next(f for f in fields(ServerConfig) if f.name == name)
    return f.default is None or f.default is MISSING


def env_values(environ: Mapping[str, str] | None = None) -> tuple[dict[str, Any], list[str]]:
    """The fields set through the environment (the one place that reads it), and warnings."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    notes: list[str] = []
    for f in fields(ServerConfig):
        key = env_var(f.name)
        if key not in env:
            continue
        if f.name == "hostname" and not _is_address(env[key]):
            notes.append(f"ignoring HOSTNAME={env[key]!r} (not an IP address: the container runtime sets it to "
                         f"the host name); listening on {f.default}. Use --hostname to bind a name")
            continue
        if is_secret(f.name) and f.name != "api_key" and not env[key].strip():
            continue  # HF_TOKEN="" from a compose file: no token
        try:
            out[f.name] = convert(f.name, env[key])
        except ValueError as exc:
            raise ValueError(f"environment variable {key}: {exc}") from exc
    return out, notes


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip())
        return True
    except ValueError:
        return text.strip() == "localhost"
