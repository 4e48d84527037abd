"""The Qwen3 family decoder (also Qwen2, Llama, Mistral) over one ragged token list.

A decoder layer is pre-norm attention and a SwiGLU MLP; the norms, rotary, attention (with its
RadixMLP dispatch) and the MLP are models/families/layers.py's. Module attribute names are the
checkpoint's, so loading is a name walk (models/checkpoint/loader.py); the lm_head and score heads stay
``nn.Linear``: pooling reads rows of them.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from models.attention.spec import AttentionSpec
from models.batch import ForwardBatch
from models.checkpoint.config import ModelConfig
from models.families.layers import MLP, Attention, AttentionOps, RMSNorm, Rotary
from models.text.prompts import DEFAULT_INSTRUCTION
from models.families.protocol import RerankSpec, ScoringModel


# The yes/no reranker of this family: the Qwen3-Reranker template and words.
RERANK = RerankSpec(template="qwen3-reranker", yes="yes", no="no", instruction=DEFAULT_INSTRUCTION)

class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: AttentionOps, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, ops, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], batch: ForwardBatch) -> Tensor:
        mods: dict[str, Any] = self._modules  # NOTE: not attributes: models/families/layers.py's docstring
        x = x + mods["self_attn"](mods["input_layernorm"](x), rope, batch)
        return x + mods["mlp"](mods["post_attention_layernorm"](x))


class Qwen3Model(ScoringModel):
    """Decoder stack; forward returns hidden states *before* the final norm.

    The final `norm` and the heads (`lm_head`, `score`) are applied by models/pooling.py to pooled
    rows only.
    """

    def __init__(self, cfg: ModelConfig, ops: AttentionOps, *, rope_device: torch.device,
                 lm_head: bool = False, num_labels: int = 0):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if lm_head and not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if num_labels:
            self.score = nn.Linear(cfg.hidden_size, num_labels, bias=False)
        self.rotary = Rotary(cfg, rope_device)

    def final_norm(self, x: Tensor) -> Tensor:
        return self.norm(x)

    def forward(self, input_ids: Tensor, positions: Tensor, batch: ForwardBatch) -> Tensor:
        mods: dict[str, Any] = self._modules  # NOTE: not attributes: models/families/layers.py's docstring
        x = mods["embed_tokens"](input_ids)  # [T, E]
        rope = self.rotary(positions, x.dtype)
        for layer in mods["layers"]:
            x = layer(x, rope, batch)
        return x  # [T, E]


def build(cfg: ModelConfig, ops: AttentionOps, *, rope_device: torch.device, lm_head: bool = False,
          num_labels: int = 0) -> ScoringModel:
    """The model of a checkpoint of this family (on the current default device: meta at load)."""
    return Qwen3Model(cfg, ops, rope_device=rope_device, lm_head=lm_head, num_labels=num_labels)


def attention_spec(cfg: ModelConfig) -> AttentionSpec:
    """Plain causal softmax at head_dim ** -0.5: every backend serves it. (A Mistral window caps
    the positions served instead: models/runner.py.)"""
    return AttentionSpec(scale=cfg.head_dim ** -0.5)
