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

NOTE: the forwards read their submodules and parameters from ``self._modules`` and
``self._parameters`` rather than as attributes: the same entries (``nn.Module.__setattr__`` keeps
them current), without a call of ``nn.Module.__getattr__`` (Python, about a microsecond) for each,
some twenty per layer per forward; the modules are still called, so hooks run.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import GatherFn, GatherPairFn
from models.attention.varlen import AttentionBackend
from models.attention.lse import needs_grad
from models.batch import ForwardBatch
from models.checkpoint.config import ModelConfig, rope_inv_freq
from models.linear.packed import Linear


# The torch modules families build whose constructor initialises its parameters at random
# (``reset_parameters``): wasted work when a checkpoint overwrites every one, and on the meta
# device Embedding's ``normal_`` goes through torch._refs, whose first call imports torch._dynamo.
INIT_CLASSES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding)
_NO_INIT = threading.Lock()


def _skip_init(self: nn.Module) -> None:
    """Leave the parameters as allocated: the checkpoint fills every one (models/checkpoint/loader.py)."""


@contextlib.contextmanager
def no_init() -> Iterator[None]:
    """Modules of INIT_CLASSES built inside get their parameters allocated, never initialised.

    Only for a model whose every parameter is then loaded (the loader refuses a checkpoint that
    lacks one). The classes' method is swapped for the block's duration, under a lock.
    """
    with _NO_INIT:
        saved = {cls: cls.__dict__["reset_parameters"] for cls in INIT_CLASSES}
        for cls in saved:
            setattr(cls, "reset_parameters", _skip_init)
        try:
            yield
        finally:
            for cls, method in saved.items():
                setattr(cls, "reset_parameters", method)


class RMSNorm(nn.Module):
    """RMSNorm times `weight` (Qwen3/Llama); `offset=1.0` multiplies by (1 + weight) (Gemma)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: Tensor) -> Tensor:
        weight: Tensor = self._parameters["weight"]  # type: ignore[assignment]  # the module's docstring
        if self.offset:  # NOTE: Gemma scales in fp32 and casts after: (x_normed * (1 + w)).to(dtype)
            normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
            return (normed * (self.offset + weight.float())).to(x.dtype)
        return rms_norm(x, weight, self.eps)


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
        # soft-cap / window of this layer, passed only when set (models/attention/spec.py)
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


class Attention(nn.Module):
    """Fused QKV, optional per-head q/k RMSNorm (Qwen3), rotary, attention over the batch's layout
    (`RadixAttention`), O projection. scale (default head_dim ** -0.5), softcap and window are the
    checkpoint's (models/attention/spec.py)."""

    def __init__(self, cfg: ModelConfig, ops: AttentionOps, layer_idx: int, *, scale: float | None = None,
                 softcap: float | None = None, window: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx  # this layer's rows in the prefix cache's pool
        self.heads, self.kv_heads, self.head_dim = (cfg.num_attention_heads,
                                                    cfg.num_key_value_heads, cfg.head_dim)
        e, hd = cfg.hidden_size, cfg.head_dim
        # One GEMM for Q, K and V: rows [q | k | v] (models/checkpoint/loader.py concatenates q/k/v_proj).
        self.qkv_proj = Linear(e, (self.heads + 2 * self.kv_heads) * hd, bias=cfg.qkv_bias)
        self.fused_rows = {"qkv_proj": (self.heads * hd, self.kv_heads * hd, self.kv_heads * hd)}
        self.o_proj = Linear(self.heads * hd, e, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self._qk_weight: tuple[tuple, Tensor] | None = None  # (parameters' identity, [H+Hkv, D])
        self.scale = hd ** -0.5 if scale is None else scale
        self.radix = RadixAttention(ops, layer_idx, self.scale, softcap=softcap, window=window)

    @property
    def ops(self) -> AttentionOps:
        """The shared backend and gathers (benchmarks swap the backend on it)."""
        return self.radix.ops

    def qk_norm_weight(self) -> Tensor:
        """The q and k norms' weights, one row per head: [H+Hkv, D].

        Built once and reused, so a forward does not concatenate them in every layer (a kernel
        launch each on a GPU); built again when either parameter is replaced, moved or written
        in place (its version counter), and never cached while autograd tracks the weights.
        """
        mods: dict[str, Any] = self._modules
        qw, kw = mods["q_norm"]._parameters["weight"], mods["k_norm"]._parameters["weight"]
        if torch.is_grad_enabled() and (qw.requires_grad or kw.requires_grad):
            return torch.cat((qw.expand(self.heads, -1), kw.expand(self.kv_heads, -1)))
        key = (qw.data_ptr(), kw.data_ptr(), qw.dtype, qw.device, qw._version, kw._version)
        if self._qk_weight is None or self._qk_weight[0] != key:
            weight = torch.cat((qw.detach().expand(self.heads, -1), kw.detach().expand(self.kv_heads, -1)))
            self._qk_weight = (key, weight)
        return self._qk_weight[1]

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], batch: ForwardBatch) -> Tensor:
        t, h = x.shape[0], self.heads
        mods: dict[str, Any] = self._modules
        qkv = mods["qkv_proj"](x).view(t, h + 2 * self.kv_heads, self.head_dim)  # [T, H+2Hkv, D]
        qk, v = qkv[:, :h + self.kv_heads], qkv[:, h + self.kv_heads:]  # views [T, H+Hkv, D], [T, Hkv, D]
        if self.qk_norm:  # q and k normalised together: one norm, per-head weights [H+Hkv, D]
            qk = rms_norm(qk, self.qk_norm_weight(), mods["q_norm"].eps)
        qk = apply_rotary(qk, *rope)  # [T, H+Hkv, D], q and k rotated together
        q, k = qk[:, :h], qk[:, h:]  # row-strided views; the gathers and backends take them
        o = self.attend(q, k, v, batch)  # [T, H, D]
        return mods["o_proj"](o.reshape(t, self.heads * self.head_dim))  # [T, E]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, batch: ForwardBatch) -> Tensor:
        return self.radix.attend(q, k, v, batch)


class MLP(nn.Module):
    """Gated MLP: down(act(gate) * up); act SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, i = cfg.hidden_size, cfg.intermediate_size
        # One GEMM for gate and up: rows [gate | up] (models/checkpoint/loader.py concatenates them).
        self.gate_up_proj = Linear(e, 2 * i, bias=cfg.mlp_bias)
        self.down_proj = Linear(i, e, bias=cfg.mlp_bias)
        self.intermediate = i
        self.fused_rows = {"gate_up_proj": (i, i)}
        self.gelu = cfg.hidden_act == "gelu_tanh"

    def forward(self, x: Tensor) -> Tensor:
        mods: dict[str, Any] = self._modules
        gate, up = mods["gate_up_proj"](x).split(self.intermediate, dim=-1)  # [T, I] views
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return mods["down_proj"](act * up)
