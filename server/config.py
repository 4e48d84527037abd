"""Server configuration: one frozen dataclass whose fields map 1:1 to the CLI flags of API.md.

Every flag also reads an environment variable (the field name in upper snake case, e.g.
MAX_BATCH_TOKENS). The environment is read in exactly one place, ``env_defaults``; an explicit
command-line flag always wins over its variable.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Mapping

DEFAULT_MODEL_ID = "Qwen/Qwen3-Embedding-0.6B"


@dataclass(frozen=True)
class ServerConfig:
    """What ``radixserve`` was asked to serve, and with which limits."""

    model_id: str = DEFAULT_MODEL_ID
    revision: str | None = None
    served_model_name: str | None = None  # None: the model id
    hostname: str = "0.0.0.0"
    port: int = 8080
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str | None = None  # None: bfloat16 on cuda, float32 on cpu
    max_batch_tokens: int = 16384
    max_batch_requests: int | None = None
    max_concurrent_requests: int = 512
    max_client_batch_size: int = 64
    max_input_length: int | None = None  # None: the model's max positions
    auto_truncate: bool = True
    radix_mlp_threshold: float = 0.95
    radix_attention: str = "compact"
    # Batch formation (issue 7): fifo, or prefix (group waiting requests that share prefixes;
    # requests waiting longer than the max wait, or passed over max-skips times, go first).
    batching_policy: str = "fifo"
    batching_max_wait_ms: float = 500.0
    batching_max_skips: int = 2
    pooling: str | None = None  # None: from the checkpoint
    default_prompt_name: str | None = None
    default_prompt: str | None = None
    api_key: str | None = None
    payload_limit: int = 2_000_000
    json_output: bool = False
    # Cross-batch prefix cache: 512MiB, 2GB, 8192tokens, a byte count, auto, or 0 (off).
    prefix_cache_size: str = "auto"

    def __post_init__(self) -> None:
        if self.default_prompt_name is not None and self.default_prompt is not None:
            raise ValueError("give --default-prompt-name or --default-prompt, not both")
        if self.radix_attention not in ("compact", "paper"):
            raise ValueError(f"--radix-attention must be compact or paper, not {self.radix_attention!r}")
        if self.batching_policy not in ("fifo", "prefix"):
            raise ValueError(f"--batching-policy must be fifo or prefix, not {self.batching_policy!r}")
        if self.batching_max_wait_ms < 0 or self.batching_max_skips < 0:
            raise ValueError("--batching-max-wait-ms and --batching-max-skips must be >= 0")
        if not 0.0 <= self.radix_mlp_threshold <= 1.0:
            raise ValueError("--radix-mlp-threshold must lie in [0, 1]")
        for name in ("max_batch_tokens", "max_concurrent_requests", "max_client_batch_size", "payload_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("max_batch_requests", "max_input_length"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.pooling is not None and self.pooling not in ("last-token", "mean", "cls"):
            raise ValueError(f"--pooling must be last-token, mean or cls, not {self.pooling!r}")
        from models.prefix_cache import capacity_tokens

        capacity_tokens(self.prefix_cache_size, 1)  # raises on a malformed size

    @property
    def model_name(self) -> str:
        """The name reported by /info and the /v1 routes."""
        return self.served_model_name or self.model_id


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


def field_types() -> dict[str, type]:
    """Field name -> the scalar type its text converts to (the Optional stripped)."""
    out: dict[str, type] = {}
    for f in fields(ServerConfig):
        annotation = str(f.type)
        for scalar, kind in (("bool", bool), ("int", int), ("float", float)):
            if annotation.startswith(scalar):
                out[f.name] = kind
                break
        else:
            out[f.name] = str
    return out


def convert(name: str, text: str):
    """Convert a flag's or variable's text to the field's type ("none"/"" clear optional fields)."""
    kind = field_types()[name]
    if kind is bool:
        return parse_bool(text)
    if text.strip().lower() in ("", "none") and _optional(name):
        return None
    return kind(text)


def _optional(name: str) -> bool:
    return any(f.name == name and "None" in str(f.type) for f in fields(ServerConfig))


def env_defaults(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """The fields set through the environment (the one place that reads it)."""
    env = os.environ if environ is None else environ
    out: dict[str, object] = {}
    for f in fields(ServerConfig):
        key = env_var(f.name)
        if key in env:
            try:
                out[f.name] = convert(f.name, env[key])
            except ValueError as exc:
                raise ValueError(f"environment variable {key}: {exc}") from exc
    return out
