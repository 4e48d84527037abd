"""Choosing the attention backend once, at model build, with a probe in the model's own shapes.

Invariant: a backend runs only after it matched a float64 bottom-right causal reference on this
device, in this dtype, with the model's (H, Hkv, D) and with K/V passed the way it will be passed
in the forward (fewer K/V heads where the kernel takes them). Every backend that is not the one
running has a reason in ``AttentionBackend.rejected``; those that were tried and failed (import
error, probe mismatch, an exception) are logged at WARNING with that reason.

Order on CUDA: flash-attn, torch's varlen_attn (fp16/bf16 only: both are flash kernels), torch's
memory-efficient varlen kernel with a bottom-right mask (any float dtype), the padded batched
SDPA, then the per-run SDPA that always works. On the CPU the per-run SDPA is the fastest (the
padded path's explicit mask loses the causal fast path; docs/decisions.md, "Per-run SDPA on the
CPU"), so it is the only candidate there.
"""
from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from models.attention.varlen import (PORTABLE, AttentionBackend, AttnFn, AttnMeta, make_meta,
                              sdpa_varlen)
from models.attention.spec import HONOURS, AttentionSpec, refusal, spec_varlen

log = logging.getLogger(__name__)

HALF = (torch.float16, torch.bfloat16)
CUDA_ORDER = ("flash-attn", "torch-varlen", "torch-varlen-repeat-kv", "efficient-varlen",
              "sdpa-padded")
CPU_DEFAULT = "sdpa"


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int


def _flash_attn() -> AttnFn:
    from flash_attn import flash_attn_varlen_func  # ImportError names a torch/ABI mismatch

    def flash(q: Tensor, k: Tensor, v: Tensor, meta: AttnMeta, *, scale: float) -> Tensor:
        # flash-attn >= 2.1 aligns the causal mask bottom-right; takes Hkv < H natively.
        return flash_attn_varlen_func(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k,
                                      meta.max_seqlen_q, meta.max_seqlen_k,
                                      softmax_scale=scale, causal=True)

    return flash


def _torch_varlen(*, repeat_kv: bool) -> AttnFn:
    """torch.nn.attention.varlen.varlen_attn, whichever keywords this torch has.

    NOTE: varlen_attn is a thin wrapper over aten._flash_attention_forward, which takes fewer
    K/V heads than query heads natively (torch 2.13's wrapper only checks divisibility when
    enable_gqa=True). On a torch whose wrapper lacks enable_gqa, K/V still go in unrepeated
    (`repeat_kv=False`) when the probe passes that way; repeating them is the fallback variant.
    """
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    extra: dict = {}
    if "window_size" in params:  # torch >= 2.12: causal is window (-1, 0)
        extra["window_size"] = (-1, 0)
    elif "is_causal" in params:  # torch 2.11
        extra["is_causal"] = True
    else:
        raise RuntimeError("varlen_attn takes neither window_size nor is_causal")
    native_gqa = "enable_gqa" in params
    if repeat_kv and native_gqa:
        raise RuntimeError("not needed: this torch's varlen_attn takes enable_gqa")
    takes_scale = "scale" in params  # NOTE: not every release has it; its default is D**-0.5

    def torch_varlen(q: Tensor, k: Tensor, v: Tensor, meta: AttnMeta, *, scale: float) -> Tensor:
        kw = dict(extra)
        if native_gqa:
            kw["enable_gqa"] = k.shape[1] != q.shape[1]
        elif repeat_kv and k.shape[1] != q.shape[1]:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [Tk, H, D]
        if takes_scale:
            kw["scale"] = scale
        elif not math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-6):
            raise ValueError(f"this torch's varlen_attn has no scale argument (got {scale})")
        out = varlen_attn(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k,
                          meta.max_seqlen_q, meta.max_seqlen_k, **kw)
        return out[0] if isinstance(out, tuple) else out  # (out, lse) where return_aux asks for it

    return torch_varlen


def _efficient_varlen() -> AttnFn:
    """aten._efficient_attention_forward over cu_seqlens, mask type 2 (causal from bottom-right):
    one launch per layer in any float dtype. Equal head counts only, so K/V are repeated."""
    op = torch.ops.aten._efficient_attention_forward
    from torch.nn.attention import bias

    bottom_right = int(bias.CausalVariant.LOWER_RIGHT)

    def efficient(q: Tensor, k: Tensor, v: Tensor, meta: AttnMeta, *, scale: float) -> Tensor:
        if k.shape[1] != q.shape[1]:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [Tk, H, D]
        # log-sum-exp only when autograd will need it (the op's backward reads it).
        lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        out = op(q[None], k[None], v[None], None, meta.cu_seqlens_q, meta.cu_seqlens_k,
                 meta.max_seqlen_q, meta.max_seqlen_k, 0.0, bottom_right, lse, scale=scale)[0]
        return out[0]  # [Tq, H, D]

    return efficient


def _varlen_lacks_gqa() -> bool | None:
    """True when this torch's varlen_attn has no enable_gqa keyword; None when it is absent."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:  # noqa: BLE001
        return None
    return "enable_gqa" not in inspect.signature(varlen_attn).parameters


def _portable(fn: AttnFn) -> Callable[[], AttnFn]:
    """A factory that returns ``fn`` (the portable backends need no set-up)."""
    return lambda: fn


FACTORIES: dict[str, Callable[[], AttnFn]] = {
    "flash-attn": _flash_attn,
    "torch-varlen": lambda: _torch_varlen(repeat_kv=False),
    "torch-varlen-repeat-kv": lambda: _torch_varlen(repeat_kv=True),
    "efficient-varlen": _efficient_varlen,
    **{name: _portable(fn) for name, fn in PORTABLE.items()},
}


def probe(fn: AttnFn, device: torch.device, dtype: torch.dtype, shape: Shape) -> str | None:
    """None when `fn` matches the float64 reference in the model's shapes, else the reason.

    The layout has lq < lk twice (compact mode), a single-query owner and lq == lk, and K/V
    with the model's Hkv heads, so a kernel that mishandles GQA or the mask alignment fails.
    """
    gen = torch.Generator(device="cpu").manual_seed(0)
    cu_q, cu_k = [0, 5, 8, 9, 16], [0, 9, 17, 21, 28]
    h, hkv, d = shape.heads, shape.kv_heads, shape.head_dim
    q = torch.randn(cu_q[-1], h, d, generator=gen)
    k = torch.randn(cu_k[-1], hkv, d, generator=gen)
    v = torch.randn(cu_k[-1], hkv, d, generator=gen)
    scale = d ** -0.5
    q, k, v = (t.to(dtype).double() for t in (q, k, v))  # the kernel's own inputs, exactly
    want = sdpa_varlen(q, k, v, make_meta(cu_q, cu_k, "cpu"), scale=scale)
    # NOTE: the forward passes row-strided head slices of the fused QKV output
    # (models/families/layers.py), so the probe does too: a kernel that assumes packed rows fails
    # here, not in a batch.
    qk_q = torch.cat((q, q.new_zeros(q.shape[0], hkv, d)), dim=1).to(device, dtype)  # [Tq, H+Hkv, D]
    kv = torch.cat((k.new_zeros(k.shape[0], h, d), k, v), dim=1).to(device, dtype)  # [Tk, H+2Hkv, D]
    qd, kd, vd = qk_q[:, :h], kv[:, h:h + hkv], kv[:, h + hkv:]
    try:
        got = fn(qd, kd, vd, make_meta(cu_q, cu_k, device), scale=scale)
        got = got.double().cpu()
    except Exception as exc:  # noqa: BLE001 - any failure means: not this backend
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
    if got.shape != want.shape:
        return f"probe: output shape {tuple(got.shape)}, want {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    tol = 2e-2 if dtype in HALF else 1e-3
    if not math.isfinite(err) or err > tol:
        return f"probe: max abs error {err:.3g} > {tol:g} against the bottom-right causal reference"
    return None


def candidates(device: torch.device, dtype: torch.dtype) -> tuple[list[str], dict[str, str]]:
    """(names to try in order, {name: why not applicable here})."""
    if device.type != "cuda":
        skipped = {name: f"needs CUDA (device is {device.type})" for name in CUDA_ORDER
                   if name != "sdpa-padded"}
        skipped["sdpa-padded"] = ("slower than the per-run sdpa on the CPU "
                                  "(docs/decisions.md); used on CUDA without a fused kernel")
        return [], skipped
    skipped = {}
    names = list(CUDA_ORDER)
    if dtype not in HALF:
        for name in ("flash-attn", "torch-varlen", "torch-varlen-repeat-kv"):
            skipped[name] = f"takes float16/bfloat16 only (dtype is {str(dtype).replace('torch.', '')})"
            names.remove(name)
    return names, skipped


def build_backend(name: str, device: torch.device | str, *, dtype: torch.dtype,
                  shape: Shape) -> tuple[AttnFn | None, str | None]:
    """(fn, None) when backend `name` builds and passes its probe here, else (None, reason)."""
    device = torch.device(device)
    try:
        fn = FACTORIES[name]()
    except Exception as exc:  # noqa: BLE001 - ImportError of a mismatched build, and the like
        return None, f"{type(exc).__name__}: {str(exc).strip()[:200]}"
    reason = probe(fn, device, dtype, shape)
    return (fn, None) if reason is None else (None, reason)


def select_backend(device: torch.device | str, *, dtype: torch.dtype, heads: int, kv_heads: int,
                   head_dim: int, spec: AttentionSpec | None = None) -> AttentionBackend:
    """The attention backend for this device, dtype and head layout; see the module docstring.

    spec: what the checkpoint needs beyond causal softmax (models/attention/spec.py); backends
    that cannot honour it are refused with the reason logged, and ``spec-varlen`` serves it.
    """
    device = torch.device(device)
    if spec is not None and spec.needs():
        return _select_for_spec(device, dtype, spec)
    shape = Shape(heads, kv_heads, head_dim)
    names, rejected = candidates(device, dtype)
    for name, why in rejected.items():
        log.info("attention backend %s not used: %s", name, why)
    for k, name in enumerate(names):
        if name == "torch-varlen-repeat-kv" and (heads == kv_heads or "torch-varlen" not in rejected
                                                 or _varlen_lacks_gqa() is not True):
            rejected[name] = "not needed: tried only when a varlen_attn without enable_gqa fails GQA"
            continue
        fn, reason = build_backend(name, device, dtype=dtype, shape=shape)
        if fn is not None:
            for later in names[k + 1:]:
                rejected.setdefault(later, f"not tried: {name} passed first")
            rejected[CPU_DEFAULT] = f"not needed: {name} passed"
            return AttentionBackend(name, fn, rejected)
        rejected[name] = reason or "unknown"  # build_backend gives a reason whenever fn is None
        log.warning("attention backend %s rejected on %s %s (H=%d, Hkv=%d, D=%d): %s", name,
                    device, str(dtype).replace("torch.", ""), heads, kv_heads, head_dim, reason)
    return AttentionBackend(CPU_DEFAULT, PORTABLE[CPU_DEFAULT], rejected)


def _select_for_spec(device: torch.device, dtype: torch.dtype, spec: AttentionSpec) -> AttentionBackend:
    """The backend of a spec with soft-cap or window: every other one is refused, logged."""
    rejected = {}
    for name in (*CUDA_ORDER, CPU_DEFAULT):
        reason = refusal(name, HONOURS.get(name, frozenset()), spec)
        if reason is not None:
            rejected[name] = reason
            log.info("attention backend %s refused: %s", name, reason)
    return AttentionBackend("spec-varlen", spec_varlen, rejected, honours=HONOURS["spec-varlen"])
