"""Choosing the tree-attention path once, at model build, with a probe on a small trie.

Invariant: as for the attention backends (models/attention/select.py), a path runs only after it
matched a float64 reference here, on this device and dtype, in the model's head layout: the
flat compact attention over each owner's gathered keys, on a trie with a segment read by
non-adjacent owners, one read by adjacent ones, a pool offset before the new rows, and an owner
without ancestors. CPU: per-segment flash calls (models/attention/tree.py, ``tree_cpu``); CUDA:
two varlen calls whose kernels return the log-sum-exp (flash-attn, then torch's varlen_attn, then
aten's flash op beneath it; fp16/bf16); with none, tree attention is off and ``rejected`` says why.
"""
from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from models.attention.varlen import make_meta, sdpa_varlen
from models.attention.select import HALF, Shape
from models.attention.spec import AttentionSpec, refusal
from models.attention.tree import TreeFn, auto_plans_tree, plan_tree, tree_cpu, tree_varlen

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TreeBackend:
    name: str
    fn: TreeFn


def _flash_attn_lse() -> TreeFn:
    from flash_attn import flash_attn_varlen_func

    def lse_fn(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale):
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale,
                                             causal=causal, return_attn_probs=True)
        return out, lse.transpose(0, 1)  # lse [H, Tq] -> [Tq, H] (flash-attn >= 2.4 layout)

    return tree_varlen(lse_fn)


def _torch_varlen_lse() -> TreeFn:
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    params = inspect.signature(varlen_attn).parameters
    if "window_size" not in params or "enable_gqa" not in params:
        raise RuntimeError("needs varlen_attn with window_size, enable_gqa and return_aux")

    def lse_fn(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale):
        out, aux = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale,
                               window_size=(-1, 0) if causal else (-1, -1),
                               enable_gqa=k.shape[1] != q.shape[1], return_aux=AuxRequest(lse=True))
        return out, aux.lse.transpose(0, 1)  # [H, Tq] -> [Tq, H]

    return tree_varlen(lse_fn)


def _aten_flash_lse() -> TreeFn:
    """aten's own flash kernel, the op under varlen_attn, on a torch whose varlen_attn cannot
    return the log-sum-exp (2.11 and older): native GQA, varlen through cu_seq, lse [H, Tq]."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None:
        raise RuntimeError("this torch has no aten._flash_attention_forward")

    def lse_fn(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale):
        out, lse = op(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)[:2]
        if lse.dim() != 2 or lse.shape[1] != q.shape[0]:
            raise RuntimeError(f"log-sum-exp of shape {tuple(lse.shape)}, not [H, Tq]")
        return out, lse.transpose(0, 1)  # [H, Tq] -> [Tq, H]

    return tree_varlen(lse_fn)


TREE_FACTORIES = {"cpu-flash": lambda: tree_cpu, "flash-attn-lse": _flash_attn_lse,
                  "torch-varlen-lse": _torch_varlen_lse, "aten-flash-lse": _aten_flash_lse}


def probe_tree(fn: TreeFn, device: torch.device, dtype: torch.dtype, shape: Shape) -> str | None:
    """None when the tree path matches the float64 flat reference on a small trie, else why not.

    The trie has a segment read by non-adjacent owners, one read by adjacent ones, a pool-like
    offset before the new rows, owners without ancestors and GQA in the model's head layout.
    """
    gen = torch.Generator(device="cpu").manual_seed(0)
    # two "pool" rows 0-1, then new rows: owner 0 = [2..7), owner 1 (after 2 rows of owner 0),
    # owner 2 (no ancestors), owner 3 (after the pool rows and 4 rows of owner 0)
    cu_q, blocks = [0, 5, 8, 12, 14], [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 7, 8, 9], [10, 11, 12, 13],
                                        [0, 1, 2, 3, 4, 5, 14, 15]]
    cu_k = np.concatenate([[0], np.cumsum([len(b) for b in blocks])])
    kv = np.concatenate(blocks)
    h, hkv, d = shape.heads, shape.kv_heads, shape.head_dim
    q = torch.randn(cu_q[-1], h, d, generator=gen).to(dtype).double()
    k = torch.randn(16, hkv, d, generator=gen).to(dtype).double()
    v = torch.randn(16, hkv, d, generator=gen).to(dtype).double()
    scale = d ** -0.5
    want = sdpa_varlen(q, k[kv], v[kv], make_meta(cu_q, cu_k, "cpu"), scale=scale)
    try:
        plan = plan_tree(cu_q, cu_k, kv, own_offset=2, heads=h, kv_heads=hkv, head_dim=d,
                         device=device, force=True)
        got = fn(q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), plan, scale=scale)
        got = got.double().cpu()
    except Exception as exc:  # noqa: BLE001 - any failure means: not this path
        return f"{type(exc).__name__}: {str(exc).strip()[:200]}"
    err = (got - want).abs().max().item() if got.shape == want.shape else float("inf")
    tol = 2e-2 if dtype in HALF else 1e-3
    if not math.isfinite(err) or err > tol:
        return f"probe: max abs error {err:.3g} > {tol:g} against the flat reference"
    return None


def select_tree(device: torch.device | str, *, dtype: torch.dtype, heads: int, kv_heads: int,
                head_dim: int, spec: AttentionSpec | None = None) -> tuple[TreeBackend | None, dict[str, str]]:
    """(the tree-attention path for this device, or None; {path: why not}).

    CPU: the per-segment flash calls with their log-sum-exp. CUDA: flash-attn, then torch's
    varlen_attn, then aten's flash op, each returning the log-sum-exp (fp16/bf16); without one,
    tree attention is off.
    """
    device = torch.device(device)
    if spec is not None and spec.needs():  # no tree path soft-caps or windows its segments
        return None, {n: refusal(n, frozenset(), spec) or "" for n in TREE_FACTORIES}
    shape = Shape(heads, kv_heads, head_dim)
    names = (["cpu-flash"] if device.type == "cpu"
             else ["flash-attn-lse", "torch-varlen-lse", "aten-flash-lse"])
    rejected = {n: f"not for {device.type}" for n in TREE_FACTORIES if n not in names}
    if device.type == "cuda" and dtype not in HALF:
        for n in names:
            rejected[n] = "takes float16/bfloat16 only"
        names = []
    for name in names:
        try:
            fn = TREE_FACTORIES[name]()
        except Exception as exc:  # noqa: BLE001
            rejected[name] = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
            continue
        reason = probe_tree(fn, device, dtype, shape)
        if reason is None:
            return TreeBackend(name, fn), rejected
        rejected[name] = reason
        log.warning("tree attention path %s rejected on %s: %s", name, device, reason)
    return None, rejected


def describe_tree(policy: str, path: TreeBackend | None, rejected: dict[str, str],
                  device: torch.device) -> str:
    """/info's tree_attention: e.g. "auto (cpu-flash)", or "off (...)" with why no path runs."""
    if path is None or policy == "off":
        why = "; ".join(f"{k}: {v}" for k, v in rejected.items()) or "off"
        return f"off ({why})" if policy != "off" else "off"
    if policy == "auto" and not auto_plans_tree(device):
        return (f"auto ({path.name}; flat on {device.type}, where the tree measured slower; "
                "--tree-attention on forces it)")
    return f"{policy} ({path.name})"
