"""Varlen causal attention behind one signature, the backend chosen once at model build.

    backend(q [Tq, H, D], k [Tk, Hkv, D], v [Tk, Hkv, D], meta, *, scale) -> [Tq, H, D]

Invariant: the causal mask is aligned bottom-right. Query i of a sequence with lq queries and
lk keys sees keys j <= i + lk - lq (lq == lk is plain causal; lq < lk is compact mode, where the
queries are the last lq tokens of the sequence). A GPU kernel is only used after a probe at
build time shows it implements exactly that alignment; otherwise the portable path is used.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class AttnMeta:
    cu_seqlens_q: Tensor  # [b+1] int32, on device
    cu_seqlens_k: Tensor  # [b+1] int32, on device
    max_seqlen_q: int
    max_seqlen_k: int
    host_cu_seqlens_q: tuple[int, ...]  # the same boundaries on the host, for the portable path
    host_cu_seqlens_k: tuple[int, ...]
    # Maximal runs of equal-shape sequences (q0, k0, count, lq, lk), computed once per batch
    # for the portable path (not once per layer).
    runs: tuple[tuple[int, int, int, int, int], ...]  # (q0, k0, count, lq, lk)


AttnFn = Callable[..., Tensor]


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    fn: AttnFn

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, meta: AttnMeta, *, scale: float) -> Tensor:
        return self.fn(q, k, v, meta, scale=scale)


def bottom_right_mask(lq: int, lk: int, device: torch.device) -> Tensor:
    """[lq, lk] bool, True where query i may attend key j (j <= i + lk - lq)."""
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(diagonal=lk - lq)


Run = tuple[int, int, int, int, int]  # (q0, k0, count, lq, lk)


def _runs(cu_q: tuple[int, ...], cu_k: tuple[int, ...]) -> tuple[Run, ...]:
    """Maximal runs of consecutive sequences with equal (lq, lk): (q0, k0, count, lq, lk)."""
    runs: list[list[int]] = []
    for s in range(len(cu_q) - 1):
        lq, lk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        if runs and runs[-1][3] == lq and runs[-1][4] == lk:
            runs[-1][2] += 1
        else:
            runs.append([cu_q[s], cu_k[s], 1, lq, lk])
    return tuple(tuple(r) for r in runs)  # type: ignore[misc]


def sdpa_varlen(q: Tensor, k: Tensor, v: Tensor, meta: AttnMeta, *, scale: float) -> Tensor:
    """Portable path: one SDPA call per run of equal-shape consecutive sequences.

    Consecutive sequences with the same (lq, lk) are views of the packed tensors, so a run is a
    batched [g, H, L, D] call without copies (a prefix-sharing batch is one or two runs). Uses
    host boundaries only: no device sync.
    """
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    outs = []
    for q0, k0, count, lq, lk in meta.runs:
        if lq == 0:
            continue
        qs = q[q0:q0 + count * lq].view(count, lq, heads, dim).transpose(1, 2)  # [g, H, lq, D]
        ks = k[k0:k0 + count * lk].view(count, lk, kv_heads, dim).transpose(1, 2)  # [g, Hkv, lk, D]
        vs = v[k0:k0 + count * lk].view(count, lk, kv_heads, dim).transpose(1, 2)
        if group > 1:
            # NOTE: enable_gqa drops CPU SDPA to its math path; repeating K/V keeps the fused one.
            ks = ks.repeat_interleave(group, dim=1)  # [g, H, lk, D]
            vs = vs.repeat_interleave(group, dim=1)
        if lq == lk:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        else:
            mask = bottom_right_mask(lq, lk, q.device)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        outs.append(o.transpose(1, 2).reshape(count * lq, heads, dim))  # [g*lq, H, D]
    if not outs:  # an empty batch
        return q.new_empty((0, heads, dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def _flash_attn_fn() -> AttnFn | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:
        return None

    def flash(q: Tensor, k: Tensor, v: Tensor, meta: AttnMeta, *, scale: float) -> Tensor:
        # flash-attn >= 2.1 aligns the causal mask bottom-right (checked by the build probe).
        return flash_attn_varlen_func(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k,
                                      meta.max_seqlen_q, meta.max_seqlen_k,
                                      softmax_scale=scale, causal=True)

    return flash


def _torch_varlen_fn() -> AttnFn | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    params = inspect.signature(varlen_attn).parameters
    extra: dict = {}
    if "window_size" in params:  # torch >= 2.12: causal is window (-1, 0)
        extra["window_size"] = (-1, 0)
    elif "is_causal" in params:  # torch 2.11
        extra["is_causal"] = True
    else:
        return None
    native_gqa = "enable_gqa" in params
    takes_scale = "scale" in params  # NOTE: not every release has it; its default is D**-0.5

    def torch_varlen(q: Tensor, k: Tensor, v: Tensor, meta: AttnMeta, *, scale: float) -> Tensor:
        kw = dict(extra)
        if native_gqa:
            kw["enable_gqa"] = k.shape[1] != q.shape[1]
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        if takes_scale:
            kw["scale"] = scale
        elif not math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-6):
            raise ValueError(f"this torch's varlen_attn has no scale argument (got {scale})")
        return varlen_attn(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k,
                           meta.max_seqlen_q, meta.max_seqlen_k, **kw)

    return torch_varlen


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on `device`: on CUDA through pinned memory, without blocking the host."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def make_meta(cu_q, cu_k, device: torch.device | str) -> AttnMeta:
    """AttnMeta from host boundaries (lists, tuples or numpy arrays): host only, no sync."""
    device = torch.device(device)
    host_q, host_k = tuple(int(x) for x in cu_q), tuple(int(x) for x in cu_k)
    lq = [b - a for a, b in zip(host_q[:-1], host_q[1:])]
    lk = [b - a for a, b in zip(host_k[:-1], host_k[1:])]
    return AttnMeta(
        cu_seqlens_q=to_device(torch.tensor(host_q, dtype=torch.int32), device),
        cu_seqlens_k=to_device(torch.tensor(host_k, dtype=torch.int32), device),
        max_seqlen_q=max(lq, default=0), max_seqlen_k=max(lk, default=0),
        host_cu_seqlens_q=host_q, host_cu_seqlens_k=host_k, runs=_runs(host_q, host_k),
    )


def _probe(fn: AttnFn, device: torch.device, dtype: torch.dtype) -> bool:
    """Does `fn` run here and match the portable path, bottom-right mask and GQA included?"""
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        cu_q, cu_k = [0, 5, 8, 15], [0, 9, 17, 24]  # lq < lk twice, then lq == lk
        q = torch.randn(15, 4, 64, generator=gen).to(device, dtype)
        k = torch.randn(24, 2, 64, generator=gen).to(device, dtype)
        v = torch.randn(24, 2, 64, generator=gen).to(device, dtype)
        meta = make_meta(cu_q, cu_k, device)
        got = fn(q, k, v, meta, scale=0.125).float()
        want = sdpa_varlen(q.float(), k.float(), v.float(), meta, scale=0.125)
        return bool((got - want).abs().max() < 2e-2)
    except Exception:
        return False


def select_backend(device: torch.device | str, *, prefer: str | None = None,
                   dtype: torch.dtype = torch.bfloat16) -> AttentionBackend:
    """The attention implementation for `device`: flash-attn, torch varlen, or portable SDPA."""
    device = torch.device(device)
    candidates: list[tuple[str, AttnFn | None]] = []
    # NOTE: the fused varlen kernels take fp16/bf16 only; fp32 on CUDA uses the portable path.
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        candidates = [("flash-attn", _flash_attn_fn()), ("torch-varlen", _torch_varlen_fn())]
    if prefer is not None:
        candidates = [c for c in candidates if c[0] == prefer]
        if prefer != "sdpa" and not candidates:
            raise ValueError(f"attention backend {prefer!r} is not available on {device}")
    for name, fn in candidates:
        if fn is not None and _probe(fn, device, dtype):
            return AttentionBackend(name, fn)
    if prefer not in (None, "sdpa"):
        raise ValueError(f"attention backend {prefer!r} failed its bottom-right causal probe")
    return AttentionBackend("sdpa", sdpa_varlen)
