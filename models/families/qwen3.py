"""The Qwen3 family decoder (also Qwen2, Llama, Mistral) over one ragged token list.

Reads top to bottom like the paper: attention, MLP, decoder layer, model; the norms, rotary and
the RadixMLP attention dispatch are models/layers.py's. Module attribute names are the
checkpoint's, so loading is a name walk (models/loader.py), except two fused projections named as
vLLM/SGLang name them: `qkv_proj` = [q_proj | k_proj | v_proj] and `gate_up_proj` =
[gate_proj | up_proj], concatenated along the output rows at load time (one GEMM instead of three
and two). Their linears are ``models.linear.Linear`` (oneDNN-packed weights on the CPU); the
lm_head and score heads stay ``nn.Linear``: pooling reads rows of them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.attention_spec import AttentionSpec
from models.batch import ForwardBatch
from models.config import ModelConfig
from models.layers import AttentionOps, RadixAttention, RMSNorm, Rotary, apply_rotary, rms_norm
from models.linear import Linear
from models.protocol import ScoringModel


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: AttentionOps, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx  # this layer's rows in the prefix cache's pool
        self.heads, self.kv_heads, self.head_dim = (cfg.num_attention_heads,
                                                    cfg.num_key_value_heads, cfg.head_dim)
        e, hd = cfg.hidden_size, cfg.head_dim
        # One GEMM for Q, K and V: rows [q | k | v] (models/loader.py concatenates q/k/v_proj).
        self.qkv_proj = Linear(e, (self.heads + 2 * self.kv_heads) * hd, bias=cfg.qkv_bias)
        self.fused_rows = {"qkv_proj": (self.heads * hd, self.kv_heads * hd, self.kv_heads * hd)}
        self.o_proj = Linear(self.heads * hd, e, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = hd ** -0.5
        self.radix = RadixAttention(ops, layer_idx, self.scale)

    @property
    def ops(self) -> AttentionOps:
        """The shared backend and gathers (benchmarks swap the backend on it)."""
        return self.radix.ops

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], batch: ForwardBatch) -> Tensor:
        t, h = x.shape[0], self.heads
        qkv = self.qkv_proj(x).view(t, h + 2 * self.kv_heads, self.head_dim)  # [T, H+2Hkv, D]
        qk, v = qkv[:, :h + self.kv_heads], qkv[:, h + self.kv_heads:]  # views [T, H+Hkv, D], [T, Hkv, D]
        if self.qk_norm:  # q and k normalised together: one norm, per-head weights [H+Hkv, D]
            weight = torch.cat((self.q_norm.weight.expand(h, -1),
                                self.k_norm.weight.expand(self.kv_heads, -1)))
            qk = rms_norm(qk, weight, self.q_norm.eps)
        qk = apply_rotary(qk, *rope)  # [T, H+Hkv, D], q and k rotated together
        q, k = qk[:, :h], qk[:, h:]  # row-strided views; the gathers and backends take them
        o = self.attend(q, k, v, batch)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.heads * self.head_dim))  # [T, E]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, batch: ForwardBatch) -> Tensor:
        return self.radix.attend(q, k, v, batch)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, i = cfg.hidden_size, cfg.intermediate_size
        # One GEMM for gate and up: rows [gate | up] (models/loader.py concatenates them).
        self.gate_up_proj = Linear(e, 2 * i, bias=cfg.mlp_bias)
        self.down_proj = Linear(i, e, bias=cfg.mlp_bias)
        self.intermediate = i
        self.fused_rows = {"gate_up_proj": (i, i)}

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)  # [T, I] views
        return self.down_proj(F.silu(gate) * up)  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: AttentionOps, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, ops, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], batch: ForwardBatch) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        x = self.embed_tokens(input_ids)  # [T, E]
        rope = self.rotary(positions, x.dtype)
        for layer in self.layers:
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
