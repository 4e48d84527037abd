"""Model configuration read from a Hugging Face config.json (Qwen3, Qwen2, Llama, Mistral, Gemma,
Gemma2).

Invariant: every number the forward depends on comes from the file. In particular rope_theta is
read from the top level (hub layout, next to `rope_scaling`) or from `rope_parameters`
(transformers 5 layout); it only defaults to 10000 when neither holds it, as in transformers.
RoPE scaling types we do not implement are rejected here, not silently ignored.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GEMMA = ("gemma", "gemma2")
# The config.json layouts this module reads (each switch below names its type). Which of them are
# served, and by which family, is models/families/registry.py's answer; a test keeps the two equal.
READ_TYPES = ("qwen3", "qwen2", "llama", "mistral", *GEMMA)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def read_config(path: str | Path) -> dict[str, Any]:
    """The checkpoint directory's config.json as a dict (FileNotFoundError naming the directory)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in {file.parent}")
    return json.loads(file.read_text())


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling ("default" means none)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    architectures: tuple[str, ...]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool  # q_norm / k_norm on each head (Qwen3)
    qkv_bias: bool  # bias on q/k/v projections (Qwen2; Llama's attention_bias)
    o_bias: bool  # bias on o_proj (Llama's attention_bias)
    mlp_bias: bool  # bias on gate/up/down (Llama's mlp_bias)
    sliding_window: int | None  # only when the model actually uses one
    # a classification head's labels in row order (id2label; transformers' default is 2 labels)
    labels: tuple[str, ...] = ()
    bos_token_id: int | None = None  # config.json's; a template that starts with <bos> reads it
    # config.json's; a score head reads the last token that is not this one (transformers' rule)
    pad_token_id: int | None = None
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh" (Gemma)
    # Gemma2: score scale query_pre_attn_scalar ** -0.5, tanh soft-caps of attention logits and of
    # the lm_head's logits, and each layer's sliding window (None: full attention)
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    layer_windows: tuple[int | None, ...] = ()

    @property
    def is_causal_lm(self) -> bool:
        return any(a.endswith("ForCausalLM") for a in self.architectures)

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(read_config(path))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        model_type = d.get("model_type", "")
        if model_type not in READ_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}: no config.json layout for it here; "
                             f"read: {', '.join(READ_TYPES)}")
        act = _activation(d, model_type)
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // heads
        theta, scaling = _rope(d)
        attention_bias = bool(d.get("attention_bias", False))
        biased = model_type in ("llama", "qwen3", *GEMMA) and attention_bias  # Mistral has no biases
        gemma2 = model_type == "gemma2"
        if d.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention is not served: attention here is causal")
        if d.get("is_causal") is False:  # vLLM reads it so (the gte-Qwen2 family's bidirectional attention)
            raise ValueError("config.json says is_causal false (bidirectional attention), which is not served: "
                             "attention here is causal")
        return cls(
            model_type=model_type,
            architectures=tuple(d.get("architectures") or ()),
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            qkv_bias=model_type == "qwen2" or biased,
            o_bias=biased,
            mlp_bias=model_type == "llama" and bool(d.get("mlp_bias", False)),  # Llama only
            sliding_window=None if gemma2 else _sliding_window(d, model_type),
            labels=_labels(d),
            bos_token_id=int(d["bos_token_id"]) if isinstance(d.get("bos_token_id"), int) else None,
            pad_token_id=int(d["pad_token_id"]) if isinstance(d.get("pad_token_id"), int) else None,
            hidden_act=act,
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)) if gemma2 else None,
            attn_logit_softcapping=_optional(d, "attn_logit_softcapping") if gemma2 else None,
            final_logit_softcapping=_optional(d, "final_logit_softcapping") if gemma2 else None,
            layer_windows=_layer_windows(d, int(d["num_hidden_layers"])) if gemma2 else (),
        )


def _rope(d: dict[str, Any]) -> tuple[float, RopeScaling]:
    """(theta, scaling) from the top level or from transformers 5's `rope_parameters`."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    theta = d.get("rope_theta", params.get("rope_theta", scaling.get("rope_theta", 10000.0)))
    # NOTE: transformers 5 keeps the scaling keys inside rope_parameters; the hub keeps them in
    # rope_scaling. Whichever names a non-default type wins.
    spec = scaling if scaling.get("rope_type", scaling.get("type")) else params
    rope_type = spec.get("rope_type", spec.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), RopeScaling()
    factor = float(spec["factor"])
    if rope_type == "linear":
        return float(theta), RopeScaling(rope_type="linear", factor=factor)
    return float(theta), RopeScaling(
        rope_type="llama3",
        factor=factor,
        low_freq_factor=float(spec.get("low_freq_factor", 1.0)),
        high_freq_factor=float(spec.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(spec.get("original_max_position_embeddings", 8192)),
    )


def _activation(d: dict[str, Any], model_type: str) -> str:
    """"silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU; its legacy "gelu" means the tanh form too)."""
    if model_type in GEMMA:
        act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"unsupported Gemma activation {act!r} (only gelu_pytorch_tanh)")
        return "gelu_tanh"
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} (only silu / SwiGLU)")
    return "silu"


def _optional(d: dict[str, Any], key: str) -> float | None:
    return None if d.get(key) is None else float(d[key])


def _layer_windows(d: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Gemma2's window per layer: `layer_types`, else sliding on even layers (transformers' default)."""
    window = d.get("sliding_window")
    types = d.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                     for i in range(layers)]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must name {layers} layers sliding_attention or full_attention")
    return tuple(int(window) if t == "sliding_attention" and window else None for t in types)


def _labels(d: dict[str, Any]) -> tuple[str, ...]:
    """id2label's names by row ({"0": "neg", ...}); LABEL_i for num_labels rows (default 2) without it."""
    id2label = d.get("id2label")
    if id2label:
        rows = {int(k): str(v) for k, v in id2label.items()}
        if sorted(rows) != list(range(len(rows))):
            raise ValueError(f"id2label must name rows 0..{len(rows) - 1}, got {sorted(rows)}")
        return tuple(rows[i] for i in range(len(rows)))
    return tuple(f"LABEL_{i}" for i in range(int(d.get("num_labels", 2))))


def _sliding_window(d: dict[str, Any], model_type: str) -> int | None:
    window = d.get("sliding_window")
    if not window:
        return None
    if model_type == "mistral":
        return int(window)
    # Qwen2/Qwen3 configs carry sliding_window but only apply it with use_sliding_window.
    return int(window) if d.get("use_sliding_window") else None


def rope_inv_freq(cfg: ModelConfig):
    """[D/2] float32 inverse frequencies, computed the way transformers does (then scaled)."""
    import torch

    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
    s = cfg.rope_scaling
    if s.rope_type == "linear":
        return inv_freq / s.factor
    if s.rope_type == "llama3":
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq
