"""Layers every family composes: RMSNorm, rotary, and the RadixMLP-aware attention dispatch.

Invariant: everything except attention is position-wise, so with a radix index the model runs
on the N' compact rows and only attention sees sequences (`RadixAttention.attend`):
- "off":     T = N rows, varlen causal attention over cu_seqlens.
- "paper":   T = N' rows; Q, K, V are gathered to the N-row layout (scatter), attention runs
             there, the output is gathered back to N' rows (gather).
- "compact": T = N' rows; queries stay compact (each owner's block is a suffix of it), K/V are
             gathered per owner to its full length (kv_index), causal mask aligned bottom-right.
With a prefix cache, cached nodes are not rows at all: their K/V come from the pool. A family's
attention module computes Q, K, V its own way and hands them to `RadixAttention.attend`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import GatherFn, GatherPairFn
from models.attention import AttentionBackend
from models.attention_lse import needs_grad
from models.batch import ForwardBatch
from models.config import ModelConfig, rope_inv_freq


class RMSNorm(nn.Module):
    """RMSNorm times `weight` (Qwen3/Llama); `offset=1.0` multiplies by (1 + weight) (Gemma)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: Tensor) -> Tensor:
        if self.offset:  # NOTE: Gemma scales in fp32 and casts after: (x_normed * (1 + w)).to(dtype)
            normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
            return (normed * (self.offset + self.weight.float())).to(x.dtype)
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., D] normalised over D, times weight ([D], or any shape broadcasting to x's).

    NOTE: normalise in fp32 and cast back *before* the weight, exactly as transformers does; in
    fp32 that is one fused op (weight folded in when it has x's last-dim shape).
    """
    dim = x.shape[-1]
    if x.dtype == torch.float32:
        if weight.shape == (dim,):
            return F.rms_norm(x, (dim,), weight, eps)
        return F.rms_norm(x, (dim,), None, eps) * weight
    return F.rms_norm(x.float(), (dim,), None, eps).to(x.dtype) * weight


class Rotary:
    """Precomputed cos/sin tables [P, D] (fp32), indexed by positions once per forward.

    The tables are laid out for ``apply_rotary``: cos repeated over both halves, sin negated on
    the first half, so rotation is three ops: x * cos + swap_halves(x) * sin.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device):
        inv_freq = rope_inv_freq(cfg).to(device)  # [D/2]
        pos = torch.arange(cfg.max_position_embeddings, device=device, dtype=torch.float)
        freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        self.cos = torch.cat((cos, cos), dim=-1)  # [P, D]
        self.sin = torch.cat((-sin, sin), dim=-1)  # [P, D]

    def __call__(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        cos = self.cos.index_select(0, positions).to(dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin.index_select(0, positions).to(dtype)[:, None, :]
        return cos, sin


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, D] rotated by half-split pairs (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).

    cos/sin [T, 1, D] come from ``Rotary`` (sin carries the minus sign on the first half).
    """
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] views
    return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), sin)


class AttentionOps:
    """The operations attention runs on: the attention backend and the row gathers, picked once
    when the model is built and shared by every layer."""

    def __init__(self, attention: AttentionBackend, gather_rows: GatherFn,
                 gather_rows_pair: GatherPairFn):
        self.attention, self.gather_rows, self.gather_rows_pair = attention, gather_rows, gather_rows_pair


class RadixAttention:
    """One layer's attention over the batch's layout (off / paper / compact, the prefix cache's
    pool, tree attention): what every family's attention module calls with its Q, K, V."""

    def __init__(self, ops: AttentionOps, layer_idx: int, scale: float, *,
                 softcap: float | None = None, window: int | None = None):
        self.ops, self.layer_idx, self.scale = ops, layer_idx, scale
        # soft-cap / window of this layer, passed only when set (models/attention_spec.py)
        self.extra: dict = {k: v for k, v in (("softcap", softcap), ("window", window)) if v is not None}

    def attend(self, q: Tensor, k: Tensor, v: Tensor, batch: ForwardBatch) -> Tensor:
        """q [T, H, D], k/v [T, Hkv, D] over the model's rows -> [T, H, D]."""
        ops = self.ops
        if batch.mode == "off":
            return ops.attention(q, k, v, batch.attn, scale=self.scale, **self.extra)
        if batch.mode == "paper":
            assert batch.scatter is not None and batch.gather is not None  # built with the trie
            qf = ops.gather_rows(q, batch.scatter)  # [N, H, D]
            kf, vf = ops.gather_rows_pair(k, v, batch.scatter)  # [N, Hkv, D]
            of = ops.attention(qf, kf, vf, batch.attn, scale=self.scale, **self.extra)  # [N, H, D]
            return ops.gather_rows(of, batch.gather)  # [N', H, D]
        # compact: queries stay [N', H, D]; each owner's keys are its full sequence.
        assert batch.kv_index is not None  # every compact batch has one
        if batch.cache is not None:  # keys also come from the pool: [P + N', Hkv, D]
            k, v = batch.cache.extend(self.layer_idx, k, v, ops.gather_rows_pair)
        if batch.tree is not None and not self.extra and not needs_grad(q, k, v):  # prefixes read once
            return batch.tree(q, k, v, scale=self.scale)
        kc, vc = ops.gather_rows_pair(k, v, batch.kv_index)  # [sum owner lens, Hkv, D]
        return ops.attention(q, kc, vc, batch.attn, scale=self.scale, **self.extra)
