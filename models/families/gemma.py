"""The Gemma family (Gemma, Gemma2) over one ragged token list.

What differs from the Qwen3 family, each where the checkpoint's config asks for it:
- embeddings scaled by sqrt(hidden_size) (rounded to the activations' dtype, as transformers does);
- RMSNorm times (1 + weight), normalised and scaled in fp32, then cast;
- GeGLU: the gated MLP with tanh-approximated GELU;
- Gemma2: attention scores scaled by query_pre_attn_scalar ** -0.5 and soft-capped
  (c * tanh(s / c)), a sliding window on the layers `layer_types` names, norms after attention and
  around the MLP ("sandwich" norms), and the lm_head's logits soft-capped (`final_logits`: the
  yes/no reranker's two logits pass through it; a classification head does not).
Soft-caps and windows are served by the attention spec (models/attention/spec.py): backends and
tree paths that cannot honour them are refused at load, with the reason logged.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from models.attention.spec import AttentionSpec
from models.batch import ForwardBatch
from models.checkpoint.config import ModelConfig
from models.families.layers import MLP, Attention, AttentionOps, RMSNorm, Rotary
from models.families.protocol import RerankSpec, ScoringModel
from models.text.rerank_templates import BGE_GEMMA, BGE_GEMMA_PROMPT

# The yes/no reranker of this family. Rule: a Gemma or Gemma2 causal LM served as a reranker is
# read as BAAI's bge-reranker-v2-gemma (the Gemma yes/no reranker people serve): its FlagEmbedding
# layout and prompt, scored by the "Yes" logit alone (no "no" word). Gemma has no Qwen chat
# template, so the Qwen3-Reranker layout would be wrong for it. The loader logs the template and
# /info reports it (model_type.reranker.template).
RERANK = RerankSpec(template=BGE_GEMMA, yes="Yes", no=None, instruction=BGE_GEMMA_PROMPT)

class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: AttentionOps, layer_idx: int):
        super().__init__()
        e, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(e, eps, offset=1.0)
        spec = attention_spec(cfg)
        window = cfg.layer_windows[layer_idx] if cfg.layer_windows else None
        self.self_attn = Attention(cfg, ops, layer_idx, scale=spec.scale, softcap=spec.softcap, window=window)
        self.post_attention_layernorm = RMSNorm(e, eps, offset=1.0)
        self.sandwich = cfg.model_type == "gemma2"
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(e, eps, offset=1.0)
            self.post_feedforward_layernorm = RMSNorm(e, eps, offset=1.0)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], batch: ForwardBatch) -> Tensor:
        m: dict[str, Any] = self._modules  # NOTE: not attributes: models/families/layers.py's docstring
        if not self.sandwich:  # Gemma: pre-norm, as Llama
            x = x + m["self_attn"](m["input_layernorm"](x), rope, batch)
            return x + m["mlp"](m["post_attention_layernorm"](x))
        x = x + m["post_attention_layernorm"](m["self_attn"](m["input_layernorm"](x), rope, batch))
        return x + m["post_feedforward_layernorm"](m["mlp"](m["pre_feedforward_layernorm"](x)))


class GemmaModel(ScoringModel):
    """Decoder stack; forward returns hidden states *before* the final norm."""

    def __init__(self, cfg: ModelConfig, ops: AttentionOps, *, rope_device: torch.device,
                 lm_head: bool = False, num_labels: int = 0):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)
        if lm_head and not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if num_labels:
            self.score = nn.Linear(cfg.hidden_size, num_labels, bias=False)
        self.rotary = Rotary(cfg, rope_device)
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.final_cap = cfg.final_logit_softcapping

    def final_norm(self, x: Tensor) -> Tensor:
        return self.norm(x)

    def final_logits(self, logits: Tensor) -> Tensor:
        if self.final_cap is None:
            return logits
        return self.final_cap * torch.tanh(logits / self.final_cap)

    def forward(self, input_ids: Tensor, positions: Tensor, batch: ForwardBatch) -> Tensor:
        mods: dict[str, Any] = self._modules  # NOTE: not attributes: models/families/layers.py's docstring
        x = mods["embed_tokens"](input_ids)  # [T, E]
        # NOTE: the scale is rounded to the activations' dtype first (bf16: 8.0 for hidden 64 stays exact)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        rope = self.rotary(positions, x.dtype)
        for layer in mods["layers"]:
            x = layer(x, rope, batch)
        return x  # [T, E]


def attention_spec(cfg: ModelConfig) -> AttentionSpec:
    """Gemma: head_dim ** -0.5, nothing else. Gemma2: query_pre_attn_scalar ** -0.5, its
    attention soft-cap, and the widest sliding window of its layers."""
    if cfg.model_type != "gemma2":
        return AttentionSpec(scale=cfg.head_dim ** -0.5)
    windows = [w for w in cfg.layer_windows if w is not None]
    scalar = cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else float(cfg.head_dim)
    return AttentionSpec(scale=scalar ** -0.5, softcap=cfg.attn_logit_softcapping,
                         window=max(windows) if windows else None)


def build(cfg: ModelConfig, ops: AttentionOps, *, rope_device: torch.device, lm_head: bool = False,
          num_labels: int = 0) -> ScoringModel:
    return GemmaModel(cfg, ops, rope_device=rope_device, lm_head=lm_head, num_labels=num_labels)
