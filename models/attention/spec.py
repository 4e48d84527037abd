"""What a family asks of attention beyond plain causal softmax, and the backend that honours it.

A family states one `AttentionSpec` per model: the score scale, an attention-logit soft-cap
(Gemma2: logits -> c * tanh(logits / c)) and a sliding window (a query sees the last `window`
keys, itself included; Gemma2 alternates it with full attention layer by layer). Backend
selection (models/attention/select.py) keeps only backends that honour the spec and logs why the
others were refused; the fused kernels honour neither feature, so a spec with one of them runs on
``spec_varlen`` here, which every device has.

Invariant: the mask is the backends' bottom-right causal mask (models/attention/varlen.py), with the
window counted in positions: query i of a sequence with lq queries and lk keys sits at position
i + lk - lq and sees key j iff j <= i + lk - lq and (i + lk - lq) - j < window. Every forward
mode hands attention a sequence's keys in position order from 0, so this is the checkpoint's own
mask in off, paper and compact mode and with the prefix cache's keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from models.attention.varlen import AttnMeta

FEATURES = ("softcap", "window")


@dataclass(frozen=True)
class AttentionSpec:
    """scale None: head_dim ** -0.5. softcap / window None: not used by the checkpoint."""

    scale: float | None = None
    softcap: float | None = None
    window: int | None = None  # the widest window any layer uses (a layer may use none)

    def needs(self) -> frozenset[str]:
        """The features a backend must honour to serve this spec."""
        return frozenset(f for f in FEATURES if getattr(self, f) is not None)


def refusal(name: str, honours: frozenset[str], spec: AttentionSpec) -> str | None:
    """Why backend `name` cannot serve `spec`, or None when it can."""
    missing = sorted(spec.needs() - honours)
    if not missing:
        return None
    return "cannot honour the checkpoint's attention " + " and ".join(f"{f} {getattr(spec, f)}" for f in missing)


QUERY_BLOCK = 256  # queries per softmax: bounds the fp32 logits to [H, 256, keys] however long the sequence


def spec_varlen(q: Tensor, k: Tensor, v: Tensor, meta: AttnMeta, *, scale: float,
                softcap: float | None = None, window: int | None = None) -> Tensor:
    """q [Tq, H, D], k/v [Tk, Hkv, D] -> [Tq, H, D], one explicit softmax per block of queries.

    Logits in fp32 (soft-capped, masked), as the eager reference computes them. A block reads only
    the keys it can see: those up to its last query's position, and with a window only those
    within `window` of its first query.
    """
    h, hkv = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    cq, ck = meta.host_cu_seqlens_q, meta.host_cu_seqlens_k
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        for s0 in range(0, lq, QUERY_BLOCK):
            s1 = min(s0 + QUERY_BLOCK, lq)
            first, last = s0 + lk - lq, s1 - 1 + lk - lq  # positions of the block's queries
            j0 = 0 if window is None else max(0, first - window + 1)
            qs = q[cq[b] + s0:cq[b] + s1].transpose(0, 1).float()  # [H, n, D]
            ks = k[ck[b] + j0:ck[b] + last + 1].transpose(0, 1).float().repeat_interleave(h // hkv, dim=0)
            vs = v[ck[b] + j0:ck[b] + last + 1].transpose(0, 1).float().repeat_interleave(h // hkv, dim=0)
            logits = qs @ ks.transpose(1, 2) * scale  # [H, n, m]
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            pos_q = torch.arange(first, last + 1, device=q.device)[:, None]  # [n, 1]
            pos_k = torch.arange(j0, last + 1, device=q.device)[None, :]  # [1, m]
            visible = pos_k <= pos_q
            if window is not None:
                visible = visible & (pos_q - pos_k < window)
            logits = logits.masked_fill(~visible, float("-inf"))
            out[cq[b] + s0:cq[b] + s1] = (logits.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)  # [n, H, D]
    return out


HONOURS: dict[str, frozenset[str]] = {"spec-varlen": frozenset(FEATURES)}
