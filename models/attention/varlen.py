"""Varlen causal attention behind one signature, the backend chosen once at model build.

    backend(q [Tq, H, D], k [Tk, Hkv, D], v [Tk, Hkv, D], meta, *, scale) -> [Tq, H, D]

Invariant: the causal mask is aligned bottom-right. Query i of a sequence with lq queries and
lk keys sees keys j <= i + lk - lq (lq == lk is plain causal; lq < lk is compact mode, where the
queries are the last lq tokens of the sequence). A GPU kernel is only used after a probe at
build time shows it implements exactly that alignment (models/attention/select.py).

The two portable paths here run on any device:
- ``sdpa_varlen``: one SDPA call per run of equal-shape sequences (views, no copies). Fastest on
  CPU; on a GPU a compact batch, where owners rarely share (lq, lk), is one small launch each.
  On the CPU an owner with lq < lk builds no [lq, lk] mask: its keys are split into the prefix
  (no mask) and its own block (causal), merged by log-sum-exp (``split_prefix``), and a causal
  run (lq == lk) is the same flash call as a tree's own block: K/V heads are not repeated per
  query head where the kernel broadcasts them (models/attention/lse.py). With narrow heads, many
  short sequences of different shapes share batched calls by prefix length (``short_plan``).
- ``sdpa_padded``: sequences padded into a few [b, H, Lq, Lk] batches with bool masks built once
  per batch on the host (``AttnMeta.padded``): one SDPA call per layer in the common case.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import numpy as np

import torch
import torch.nn.functional as F
from torch import Tensor

from models.streams import to_device
from models.attention.lse import block_lse, merge_two, needs_grad


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

    @cached_property
    def padded(self) -> "PaddedPlan":
        """The padded layout for ``sdpa_padded``: built on the host on first use, once per batch.

        NOTE: cached on the instance (a frozen dataclass still has a __dict__), so the first
        layer pays it and every later layer reuses it; the copies to the device are non-blocking.
        """
        return padded_plan(self.host_cu_seqlens_q, self.host_cu_seqlens_k,
                           self.cu_seqlens_q.device)

    @cached_property
    def short(self) -> "ShortPlan":
        """``sdpa_varlen``'s CPU split: which runs keep their own calls and which short
        sequences share batched calls (``short_plan``); built with the batch on the CPU
        (``make_meta``), so the forward reads host-built index tensors only."""
        return short_plan(self.runs, self.host_cu_seqlens_q, self.host_cu_seqlens_k)


AttnFn = Callable[..., Tensor]


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    fn: AttnFn
    # Why each other backend is not the one running: {name: reason} (start-up log, /info).
    rejected: dict[str, str] = field(default_factory=dict, compare=False)
    # What it honours beyond plain causal attention (models/attention/spec.py): "softcap", "window"
    honours: frozenset[str] = field(default=frozenset(), compare=False)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, meta: AttnMeta, *, scale: float,
                 softcap: float | None = None, window: int | None = None) -> Tensor:
        """Causal attention; `softcap` (logits -> c tanh(logits / c)) and `window` (a query sees
        the last `window` keys, itself included) only where selection found them honoured."""
        if softcap is None and window is None:
            return self.fn(q, k, v, meta, scale=scale)
        return self.fn(q, k, v, meta, scale=scale, softcap=softcap, window=window)


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
    host boundaries only: no device sync. On the CPU, with narrow heads, the short sequences of
    runs too small to pay for their own calls (a compact batch's short owners, each of its own
    shape) share batched calls by prefix length instead, exactly (``short_plan``).
    """
    heads, dim = q.shape[1], q.shape[2]
    # NOTE: on the CPU a compact owner (lq < lk) never gets a dense [lq, lk] mask: its keys are
    # split at lk - lq (see split_prefix). Autograd, and other devices, take the masked call.
    split = q.device.type == "cpu" and not needs_grad(q, k, v)
    plan = meta.short if split and (heads + 2 * k.shape[1]) * dim <= SHORT_WIDTH else None
    if plan is None or not plan.buckets:
        outs = [o for run in meta.runs if (o := _run(q, k, v, run, split=split, scale=scale)) is not None]
        if not outs:  # an empty batch
            return q.new_empty((0, heads, dim))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
    out = q.new_empty(q.shape)  # [Tq, H, D]: every row is written once below
    for run in plan.runs:
        o = _run(q, k, v, run, split=True, scale=scale)
        if o is not None:
            out[run[0]:run[0] + run[2] * run[3]] = o
    _short_buckets(q, k, v, plan.buckets, out, scale=scale)
    return out


def _run(q: Tensor, k: Tensor, v: Tensor, run: "Run", *, split: bool, scale: float) -> Tensor | None:
    """One run's attention, [count*lq, H, D] (None when its sequences have no queries)."""
    q0, k0, count, lq, lk = run
    if lq == 0:
        return None
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    qs = q[q0:q0 + count * lq].view(count, lq, heads, dim).transpose(1, 2)  # [g, H, lq, D]
    ks = k[k0:k0 + count * lk].view(count, lk, kv_heads, dim).transpose(1, 2)  # [g, Hkv, lk, D]
    vs = v[k0:k0 + count * lk].view(count, lk, kv_heads, dim).transpose(1, 2)
    if lq < lk and split:  # prefix keys (no mask) + the diagonal block (causal), merged
        return split_prefix(qs, ks, vs, lk - lq, scale=scale).transpose(1, 2).reshape(count * lq, heads, dim)
    if split:  # lq == lk: the same causal kernel call, K/V heads as they are where it can
        return block_lse(qs, ks, vs, causal=True, scale=scale)[0].transpose(1, 2).reshape(count * lq, heads, dim)
    if group > 1:
        # NOTE: enable_gqa drops CPU SDPA to its math path; repeating K/V keeps the fused one.
        ks = ks.repeat_interleave(group, dim=1)  # [g, H, lk, D]
        vs = vs.repeat_interleave(group, dim=1)
    if lq == lk:
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
    else:
        mask = bottom_right_mask(lq, lk, q.device)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
    return o.transpose(1, 2).reshape(count * lq, heads, dim)  # [g*lq, H, D]


def split_prefix(q: Tensor, k: Tensor, v: Tensor, prefix: int, *, scale: float) -> Tensor:
    """Bottom-right causal attention of q [g, H, lq, D] over k/v [g, Hkv, prefix + lq, D] as two
    blocks: every query sees the first `prefix` keys (no mask), then its own block causally;
    the two partials are merged exactly by their log-sum-exp. Memory O(rows x keys-per-tile)."""
    o1, lse1 = block_lse(q, k[:, :, :prefix], v[:, :, :prefix], causal=False, scale=scale)
    o2, lse2 = block_lse(q, k[:, :, prefix:], v[:, :, prefix:], causal=True, scale=scale)
    return merge_two(o1, lse1, o2, lse2)[0]  # [g, H, lq, D]


def make_meta(cu_q, cu_k, device: torch.device | str) -> AttnMeta:
    """AttnMeta from host boundaries (lists, tuples or numpy arrays): host only, no sync."""
    device = torch.device(device)
    host_q, host_k = tuple(int(x) for x in cu_q), tuple(int(x) for x in cu_k)
    lq = [b - a for a, b in zip(host_q[:-1], host_q[1:])]
    lk = [b - a for a, b in zip(host_k[:-1], host_k[1:])]
    meta = AttnMeta(
        cu_seqlens_q=to_device(torch.tensor(host_q, dtype=torch.int32), device),
        cu_seqlens_k=to_device(torch.tensor(host_k, dtype=torch.int32), device),
        max_seqlen_q=max(lq, default=0), max_seqlen_k=max(lk, default=0),
        host_cu_seqlens_q=host_q, host_cu_seqlens_k=host_k, runs=_runs(host_q, host_k),
    )
    if device.type == "cpu":
        meta.short  # noqa: B018 - the CPU split's index tensors are built here, never inside the forward
    return meta


@dataclass(frozen=True)
class PaddedBucket:
    """Sequences padded to one [b, Lq, Lk] shape; row indices into the packed q and k/v."""
    q_index: Tensor  # [b*Lq] int64 packed q row of each padded query slot (0 in padding)
    k_index: Tensor  # [b*Lk] int64 packed k/v row of each padded key slot (0 in padding)
    mask: Tensor  # [b, 1, Lq, Lk] bool, bottom-right causal; padding queries see key 0 only
    out_index: Tensor  # [rows] int64 padded slots that hold real queries, in q_rows order
    q_rows: Tensor  # [rows] int64 the packed q rows those slots answer
    shape: tuple[int, int, int]  # (b, Lq, Lk)


@dataclass(frozen=True)
class PaddedPlan:
    buckets: tuple[PaddedBucket, ...]
    rows: int  # Tq
    whole: bool  # one bucket whose out_index lists every q row in order: no scatter needed


MAX_PAD_FACTOR = 4.0  # a bucket's padded score cells stay <= this x its real ones


def _bucket_groups(lq: np.ndarray, lk: np.ndarray) -> list[np.ndarray]:
    """Which sequences share a padded call: greedy over sequences sorted by (lq, lk) descending,
    a bucket grows while its padded score cells stay <= MAX_PAD_FACTOR x its real ones.

    So padding never costs more than MAX_PAD_FACTOR x the unpadded work (memory and FLOPs), and a
    batch of similar shapes, or compact mode's one long owner plus many short ones, is one or two
    calls. Host-side, once per batch: a loop over sequences, never over tokens.
    """
    live = np.flatnonzero(lq > 0)
    order = live[np.lexsort((-lk[live], -lq[live]))]
    groups: list[list[int]] = []
    max_q = max_k = real = 0
    for s in order.tolist():
        a, b = int(lq[s]), int(lk[s])
        if groups:
            n = len(groups[-1]) + 1
            if n * max(max_q, a) * max(max_k, b) <= MAX_PAD_FACTOR * (real + a * b):
                groups[-1].append(s)
                max_q, max_k, real = max(max_q, a), max(max_k, b), real + a * b
                continue
        groups.append([s])
        max_q, max_k, real = a, b, a * b
    return [np.sort(np.asarray(g, np.int64)) for g in groups]  # packed order inside a bucket


def padded_plan(cu_q, cu_k, device: torch.device) -> PaddedPlan:
    """Host-side (numpy) padded layout of a varlen batch; see ``sdpa_padded``."""
    cq, ck = np.asarray(cu_q, np.int64), np.asarray(cu_k, np.int64)
    lq, lk = np.diff(cq), np.diff(ck)
    buckets, host_rows = [], []
    for seqs in _bucket_groups(lq, lk):
        b, mq, mk = len(seqs), int(lq[seqs].max()), int(lk[seqs].max())
        i = np.arange(mq)[None, :]  # [1, Lq]
        j = np.arange(mk)[None, :]  # [1, Lk]
        q_ok = i < lq[seqs, None]  # [b, Lq]
        k_ok = j < lk[seqs, None]  # [b, Lk]
        q_index = np.where(q_ok, cq[seqs, None] + i, 0)
        k_index = np.where(k_ok, ck[seqs, None] + j, 0)
        # bottom-right: query i of (lq, lk) sees key j <= i + lk - lq, and only real keys.
        mask = (j[:, None, :] <= (i[0][None, :, None] + (lk - lq)[seqs, None, None])) & k_ok[:, None, :]
        mask &= q_ok[:, :, None]
        mask[:, :, 0] |= ~q_ok  # padding queries see key 0: finite rows, discarded after
        out_index = np.flatnonzero(q_ok.reshape(-1))
        q_rows = q_index.reshape(-1)[out_index]
        host_rows.append(q_rows)
        buckets.append(PaddedBucket(
            q_index=to_device(torch.from_numpy(q_index.reshape(-1)), device),
            k_index=to_device(torch.from_numpy(k_index.reshape(-1)), device),
            mask=to_device(torch.from_numpy(np.ascontiguousarray(mask[:, None])), device),
            out_index=to_device(torch.from_numpy(out_index), device),
            q_rows=to_device(torch.from_numpy(q_rows), device), shape=(b, mq, mk)))
    rows = int(cq[-1])
    whole = len(host_rows) == 1 and np.array_equal(host_rows[0], np.arange(rows))
    return PaddedPlan(tuple(buckets), rows, whole)


def sdpa_padded(q: Tensor, k: Tensor, v: Tensor, meta: AttnMeta, *, scale: float) -> Tensor:
    """Padded batched SDPA: one call per bucket of ``meta.padded`` (one in the common case).

    Needs no fused varlen kernel, so it runs in fp32 on CUDA and on the CPU alike; the masks
    and indices come from the host once per batch, so a layer is gathers + one SDPA + a gather.
    """
    plan = meta.padded
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    out = None if plan.whole else q.new_zeros(q.shape)
    for bk in plan.buckets:
        b, lq, lk = bk.shape
        qs = q.index_select(0, bk.q_index).view(b, lq, heads, dim).transpose(1, 2)  # [b, H, Lq, D]
        ks = k.index_select(0, bk.k_index).view(b, lk, kv_heads, dim).transpose(1, 2)  # [b, Hkv, Lk, D]
        vs = v.index_select(0, bk.k_index).view(b, lk, kv_heads, dim).transpose(1, 2)
        if group > 1:  # NOTE: as in sdpa_varlen, enable_gqa would drop CPU SDPA to its math path
            ks = ks.repeat_interleave(group, dim=1)  # [b, H, Lk, D]
            vs = vs.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bk.mask, scale=scale)
        o = o.transpose(1, 2).reshape(b * lq, heads, dim).index_select(0, bk.out_index)  # [rows, H, D]
        if out is None:  # plan.whole: one bucket covers every row, in order
            return o
        out = out.index_copy(0, bk.q_rows, o)
    return out if out is not None else q.new_empty((0, heads, dim))


# The CPU's short sequences (``short_plan``): a run of fewer than SHORT_RUN sequences with at most
# SHORT_Q queries and SHORT_K keys each joins a batched call with the others of its prefix
# length, whose query rows pad at most SHORT_PAD x its real ones; a batch holds >= SHORT_MIN.
# Only where a row's q, k and v hold at most SHORT_WIDTH numbers ((H + 2 Hkv) x D): the batched
# call gathers its rows (copies), which cost more than the calls they save for wider heads, or
# for longer sequences, whose calls are mostly arithmetic (measured per layer, one CPU thread).
SHORT_RUN, SHORT_Q, SHORT_K, SHORT_PAD, SHORT_MIN, SHORT_WIDTH = 4, 32, 96, 1.5, 3, 1024


@dataclass(frozen=True)
class ShortBucket:
    """Sequences of one prefix length P, each's own rows padded at the end to L rows."""
    q_index: Tensor  # [b*L] int64 packed q row of each padded query slot (0 in padding)
    k_index: Tensor  # [b*(P+L)] int64 packed k/v row of each key slot: P prefix keys, L own (0 in padding)
    out_index: Tensor  # [rows] int64 padded slots that hold real queries
    q_rows: Tensor  # [rows] int64 the packed q rows those slots answer
    shape: tuple[int, int, int]  # (b, L, P)


@dataclass(frozen=True)
class ShortPlan:
    runs: tuple[Run, ...]  # the runs that keep their own calls
    buckets: tuple[ShortBucket, ...]


def short_plan(runs: tuple[Run, ...], cu_q, cu_k) -> ShortPlan:
    """Host-side, once per batch: short sequences of small runs grouped into batched calls.

    A run's own calls on the CPU are a chain of small ops (``split_prefix``: two flash calls and
    a merge), so many short sequences of different shapes, as a compact batch's owners are,
    spend their time in Python. Sequences with the same prefix length P = lk - lq share one
    chain: their own rows padded at the END to the bucket's L, so the causal (top-left) block
    never lets a real query see a padding key, and their P prefix keys are all real: no mask,
    nothing approximated; padding query rows are computed and dropped (<= SHORT_PAD x the real).
    """
    if len(runs) <= 1:  # a bucket merges sequences of two runs or more: one run keeps its own call
        return ShortPlan(runs, ())
    cq, ck = np.asarray(cu_q, np.int64), np.asarray(cu_k, np.int64)
    first = np.cumsum([0] + [r[2] for r in runs])  # the sequence index each run starts at
    cand = [s for i, r in enumerate(runs) if 0 < r[3] <= SHORT_Q and r[4] <= SHORT_K and r[2] < SHORT_RUN
            for s in range(int(first[i]), int(first[i + 1]))]
    if len(cand) < SHORT_MIN:
        return ShortPlan(runs, ())
    lq, lk = np.diff(cq), np.diff(ck)
    seqs = np.asarray(cand, np.int64)
    order = seqs[np.lexsort((-lq[seqs], lk[seqs] - lq[seqs]))]  # by prefix length, then longest first
    groups: list[list[int]] = []
    for s in order.tolist():
        g = groups[-1] if groups else None
        if g and lk[g[0]] - lq[g[0]] == lk[s] - lq[s] and (len(g) + 1) * lq[g[0]] <= SHORT_PAD * (lq[g].sum() + lq[s]):
            g.append(s)
        else:
            groups.append([s])
    run_of = np.repeat(np.arange(len(runs)), [r[2] for r in runs])  # [B] the run each sequence is in
    taken = np.zeros(len(lq), bool)
    buckets = []
    # NOTE: a group from one run only is that run's own batched call already: nothing to merge.
    for members in (np.sort(np.asarray(g, np.int64)) for g in groups
                    if len(g) >= SHORT_MIN and len(set(run_of[g].tolist())) > 1):
        taken[members] = True
        b, length = len(members), int(lq[members].max())
        pre = int(lk[members[0]] - lq[members[0]])
        at = np.arange(length)[None, :]  # [1, L]
        q_ok = at < lq[members, None]  # [b, L]
        q_index = np.where(q_ok, cq[members, None] + at, 0)
        key_at = np.arange(pre + length)[None, :]  # [1, P+L]
        k_index = np.where(key_at < lk[members, None], ck[members, None] + key_at, 0)
        out_index = np.flatnonzero(q_ok.reshape(-1))
        buckets.append(ShortBucket(torch.from_numpy(q_index.reshape(-1)), torch.from_numpy(k_index.reshape(-1)),
                                   torch.from_numpy(out_index), torch.from_numpy(q_index.reshape(-1)[out_index]),
                                   (b, length, pre)))
    if not buckets:
        return ShortPlan(runs, ())
    kept: list[Run] = []
    for i, r in enumerate(runs):
        own = range(int(first[i]), int(first[i + 1]))
        if not taken[own.start:own.stop].any():
            kept.append(r)
        else:  # what the buckets left of a small run: one call per sequence
            kept.extend((int(cq[s]), int(ck[s]), 1, int(lq[s]), int(lk[s])) for s in own if not taken[s])
    return ShortPlan(tuple(kept), tuple(buckets))


def _short_buckets(q: Tensor, k: Tensor, v: Tensor, buckets: tuple[ShortBucket, ...], out: Tensor, *,
                   scale: float) -> None:
    """Each bucket's prefix block and own causal block, merged; its real rows into ``out`` [Tq, H, D]."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    for bk in buckets:
        b, length, pre = bk.shape
        qs = q.index_select(0, bk.q_index).view(b, length, heads, dim).transpose(1, 2)  # [b, H, L, D]
        ks = k.index_select(0, bk.k_index).view(b, pre + length, kv_heads, dim).transpose(1, 2)  # [b, Hkv, P+L, D]
        vs = v.index_select(0, bk.k_index).view(b, pre + length, kv_heads, dim).transpose(1, 2)
        if pre:
            o = split_prefix(qs, ks, vs, pre, scale=scale)  # [b, H, L, D]
        else:
            o = block_lse(qs, ks, vs, causal=True, scale=scale)[0]
        o = o.transpose(1, 2).reshape(b * length, heads, dim).index_select(0, bk.out_index)  # [rows, H, D]
        out.index_copy_(0, bk.q_rows, o)


PORTABLE = {"sdpa": sdpa_varlen, "sdpa-padded": sdpa_padded}
