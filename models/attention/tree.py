"""Tree attention for the compact forward: a shared prefix's K/V is read once for all its readers.

Compact attention gives owner s its own block of queries (its new trie nodes, a suffix of its
sequence) and, as keys, its whole path: the rows of the ancestors' blocks it descends from,
then its own block. Here that path is split along the trie (cascade / Hydragen decomposition):

- *shared calls*: the ancestor rows are cut into segments, maximal runs of consecutive source
  rows that the same owners read; each segment is attended once, without a mask, by all the
  queries of all its readers (every such query sees the whole segment);
- *own calls*: each owner's block attends to itself causally (runs of equal-length owners are
  one batched call, views of the packed tensors);
- the partials of a query row are merged exactly by their log-sum-exp (models/attention/lse.py).

Keys are never gathered per sequence: a segment is a slice of the source K/V ([pool rows read |
new rows] with a prefix cache, so a cache hit is read once per batch and layer), and the own
blocks are the new rows themselves, in compact order. The plan is host-side numpy, built once per
batch on the prep thread; `plan_tree` also estimates the cost of this path and of the flat one
(per-owner key gather) on the CPU and returns None when the flat path is cheaper; unless forced,
it plans nothing off the CPU (`auto_plans_tree`: there the tree measured slower).

Invariant: the own-call rows of owner s are source rows own_offset + cu_q[s] .. own_offset +
cu_q[s+1] and the last lq(s) entries of its keys; `plan_tree` checks it and declines otherwise.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from models.streams import to_device
from models.attention.lse import block_lse, merge_into, merge_two, merge_two_
from models.options import TREE_ATTENTION

log = logging.getLogger(__name__)

# Rough costs of the CPU estimate: one attention call (Python + kernel set-up) and one element
# moved (a copy or a merge term), in seconds. Only their ratio matters.
CALL_S = 25e-6
ELEM_S = 0.6e-9
POLICIES = TREE_ATTENTION  # the policies `load_runner(tree_attention=...)` takes (models/options.py)


def auto_plans_tree(device: torch.device) -> bool:
    """Whether policy "auto" considers the tree on this device: the CPU only, by its estimate.
    NOTE: on a GPU both paths make the same FLOPs on a compute-bound flash kernel, so reading a
    shared prefix once saves little, while the tree adds a query gather, a second kernel call and
    a float32 merge per layer: it measured slower over the whole forward in every shape tried
    (docs/decisions.md, "Flat attention on CUDA"). So elsewhere "auto" keeps the flat path; "on"
    forces the tree."""
    return device.type == "cpu"


@dataclass(frozen=True)
class SharedCall:
    """One segment of source rows [k0, k1) and the query rows that see all of it."""
    k0: int
    k1: int
    q0: int  # contiguous query rows q0..q1 when q_index is None
    q1: int
    q_index: Tensor | None  # [nq] int64 query rows (the readers' blocks are not adjacent)


@dataclass(frozen=True)
class TreePlan:
    shared: tuple[SharedCall, ...]
    own_runs: tuple[tuple[int, int, int], ...]  # (q0, count, l): count owners of l rows each
    own_offset: int  # source row of the first owner's first own row (pool rows read come first)
    part_rows: Tensor | None  # [M] int64 query row of each shared partial, in call order
    # The same plan for two varlen kernel calls (own, shared) on a GPU:
    cu_own: Tensor  # [B'+1] int32 owner block boundaries (queries and own keys alike)
    max_own: int
    shared_k_index: Tensor | None  # [K] int64 source rows of the segments, concatenated
    cu_shared_q: Tensor | None  # [S+1] int32
    cu_shared_k: Tensor | None  # [S+1] int32
    max_shared_q: int
    max_shared_k: int
    estimate: tuple[float, float]  # (tree, flat) estimated seconds per layer



TreeFn = Callable[..., Tensor]


@dataclass(frozen=True)
class TreeAttention:
    """A batch's plan and the kernel path that runs it: `(q, k, v, *, scale) -> [Tq, H, D]`."""
    plan: TreePlan
    fn: TreeFn

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, scale: float) -> Tensor:
        return self.fn(q, k, v, self.plan, scale=scale)


def _aranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """concat(arange(s, s + n) for s, n in zip(starts, lens)), without a Python loop."""
    total = int(lens.sum())
    offsets = np.concatenate([[0], np.cumsum(lens)[:-1]]) if len(lens) else np.zeros(0, np.int64)
    return np.arange(total, dtype=np.int64) + np.repeat(starts - offsets, lens)


def _own_runs(lq: np.ndarray, cq: np.ndarray) -> tuple[tuple[int, int, int], ...]:
    """Maximal runs of consecutive owners with the same block length: (q0, count, l)."""
    if not len(lq):
        return ()
    new = np.flatnonzero(np.concatenate([[True], lq[1:] != lq[:-1]]))
    counts = np.diff(np.concatenate([new, [len(lq)]]))
    return tuple((int(cq[s]), int(c), int(lq[s])) for s, c in zip(new, counts))


def plan_tree(cu_q, cu_k, kv_index, *, own_offset: int, heads: int, kv_heads: int, head_dim: int,
              device: torch.device | str, force: bool = False) -> TreePlan | None:
    """The tree decomposition of one compact batch, or None when the flat path is estimated
    cheaper (unless `force`) or the layout is not compact (see the module invariant).

    cu_q [B'+1] owner query blocks, cu_k [B'+1] owner key lengths, kv_index [sum lk] source row of
    each owner's keys (host numpy, as the batch builder made them).
    """
    device = torch.device(device)
    if not force and not auto_plans_tree(device):
        return None
    cq, ck = np.asarray(cu_q, np.int64), np.asarray(cu_k, np.int64)
    kv = np.asarray(kv_index, np.int64)
    lq, lk = np.diff(cq), np.diff(ck)
    if not len(lq) or (lq <= 0).any() or (lk < lq).any():
        return None
    b, tq = len(lq), int(cq[-1])
    own_pos = np.arange(tq, dtype=np.int64) + np.repeat(ck[1:] - lq - cq[:-1], lq)  # [Tq]
    if not np.array_equal(kv[own_pos], own_offset + np.arange(tq, dtype=np.int64)):
        return None
    plan = _plan_one if b == 1 else _plan_many
    return plan(cq, ck, kv, own_offset=own_offset, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                device=device, force=force)


def _plan_many(cq: np.ndarray, ck: np.ndarray, kv: np.ndarray, *, own_offset: int, heads: int, kv_heads: int,
               head_dim: int, device: torch.device, force: bool) -> TreePlan | None:
    """`plan_tree` past its layout checks: the segments, the estimate, the plan."""
    lq, lk = np.diff(cq), np.diff(ck)
    b = len(lq)
    anc = lk - lq  # [B'] ancestor keys of each owner
    rows = kv[_aranges(ck[:-1], anc)]  # [A] source row of every ancestor key, owner by owner
    owner = np.repeat(np.arange(b, dtype=np.int64), anc)  # [A]
    if rows.size:
        brk = np.ones(rows.size, dtype=bool)
        brk[1:] = (owner[1:] != owner[:-1]) | (rows[1:] != rows[:-1] + 1)
        first = np.flatnonzero(brk)
        last = np.concatenate([first[1:] - 1, [rows.size - 1]])
        cuts = np.unique(np.concatenate([rows[first], rows[last] + 1]))  # segment boundaries
        seg = np.searchsorted(cuts, rows, side="right") - 1  # [A] segment of each key
        pairs = np.unique(seg * b + owner)  # (segment, reader) pairs, by segment then reader
        seg_p, own_p = pairs // b, pairs % b
    else:
        cuts = seg_p = own_p = np.zeros(0, np.int64)
    segs, seg_first = np.unique(seg_p, return_index=True)  # [S]
    readers = np.diff(np.concatenate([seg_first, [len(seg_p)]]))  # [S] owners reading each
    nq_pair = lq[own_p]  # [P] query rows each pair contributes
    part_rows = _aranges(cq[:-1][own_p], nq_pair)  # [M]
    nq_seg = np.add.reduceat(nq_pair, seg_first) if len(segs) else np.zeros(0, np.int64)
    k0, k1 = cuts[segs] if len(segs) else segs, cuts[segs + 1] if len(segs) else segs
    contiguous = own_p[seg_first + readers - 1] - own_p[seg_first] + 1 == readers  # [S]
    own_runs = _own_runs(lq, cq)

    width = heads * head_dim
    m = int(nq_seg.sum())
    gathered_q = int(nq_seg[~contiguous].sum())
    n_split = int((anc > 0).sum())
    flat = CALL_S * (len(own_runs) + n_split) + ELEM_S * (2 * kv_heads * head_dim * int(lk.sum())
                                                           + 3 * width * int(lq[anc > 0].sum()))
    tree = CALL_S * (len(own_runs) + len(segs)) + ELEM_S * (width * gathered_q + 4 * width * m)
    # NOTE: with nothing shared the two paths run the same causal calls; the flat one is kept.
    if not force and (tree > flat or not m):
        return None

    def dev(a: np.ndarray, dtype=torch.int64) -> Tensor:
        return to_device(torch.from_numpy(np.ascontiguousarray(a)).to(dtype), device)

    calls = []
    starts = np.concatenate([[0], np.cumsum(nq_seg)])
    for i in range(len(segs)):
        a, z = int(starts[i]), int(starts[i + 1])
        q0 = int(part_rows[a]) if contiguous[i] else 0
        calls.append(SharedCall(int(k0[i]), int(k1[i]), q0, q0 + z - a,
                                None if contiguous[i] else dev(part_rows[a:z])))
    seg_lens = k1 - k0
    return TreePlan(
        shared=tuple(calls), own_runs=own_runs, own_offset=int(own_offset),
        part_rows=dev(part_rows) if m else None, cu_own=dev(cq, torch.int32), max_own=int(lq.max()),
        shared_k_index=dev(_aranges(k0, seg_lens)) if m else None,
        cu_shared_q=dev(starts, torch.int32) if m else None,
        cu_shared_k=dev(np.concatenate([[0], np.cumsum(seg_lens)]), torch.int32) if m else None,
        max_shared_q=int(nq_seg.max()) if m else 0, max_shared_k=int(seg_lens.max()) if m else 0,
        estimate=(tree, flat))


def _plan_one(cq: np.ndarray, ck: np.ndarray, kv: np.ndarray, *, own_offset: int, heads: int, kv_heads: int,
              head_dim: int, device: torch.device, force: bool) -> TreePlan | None:
    """`plan_tree` of a batch of one owner (a lone request, its prefix read from the cache),
    without the segment search: its ancestors are one segment when their source rows run
    consecutively (as a cache read lays them out), read by its whole block. Any other layout
    goes through the general planner, which this equals (tests/test_tree_attention_plan_one.py)."""
    q0, lq, anc = int(cq[0]), int(cq[1] - cq[0]), int(ck[1] - ck[0] - (cq[1] - cq[0]))
    ancestors = kv[int(ck[0]):int(ck[0]) + anc]  # [anc] source rows of its ancestor keys
    if anc and not np.array_equal(ancestors, ancestors[0] + np.arange(anc, dtype=np.int64)):
        return _plan_many(cq, ck, kv, own_offset=own_offset, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                          device=device, force=force)
    width = heads * head_dim
    m = lq if anc else 0
    flat = CALL_S * (1 + (anc > 0)) + ELEM_S * (2 * kv_heads * head_dim * (lq + anc) + 3 * width * (lq if anc else 0))
    tree = CALL_S * (1 + (anc > 0)) + ELEM_S * (4 * width * m)
    if not force and (tree > flat or not m):
        return None

    def dev(a: np.ndarray, dtype=torch.int64) -> Tensor:
        return to_device(torch.from_numpy(np.ascontiguousarray(a)).to(dtype), device)

    k0 = int(ancestors[0]) if anc else 0
    rows = q0 + np.arange(lq, dtype=np.int64)  # [lq] its query rows: the partials' rows
    return TreePlan(
        shared=(SharedCall(k0, k0 + anc, q0, q0 + lq, None),) if m else (), own_runs=((q0, 1, lq),),
        own_offset=int(own_offset), part_rows=dev(rows) if m else None,
        cu_own=dev(cq, torch.int32), max_own=lq,
        shared_k_index=dev(k0 + np.arange(anc, dtype=np.int64)) if m else None,
        cu_shared_q=dev(np.array([0, lq], np.int64), torch.int32) if m else None,
        cu_shared_k=dev(np.array([0, anc], np.int64), torch.int32) if m else None,
        max_shared_q=lq if m else 0, max_shared_k=anc if m else 0, estimate=(tree, flat))


SHARED_ROWS = 4096  # query rows per piece of a CPU shared call: 32 MiB of [rows, 16, 128] fp32


def tree_cpu(q: Tensor, k: Tensor, v: Tensor, plan: TreePlan, *, scale: float) -> Tensor:
    """q [Tq, H, D], k/v [source rows, Hkv, D] -> [Tq, H, D]: own calls, shared calls, merge.

    The own calls write straight into one running accumulator (no per-run reshape, no cat);
    the shared calls merge into it in place.
    """
    heads, dim, kv_heads = q.shape[1], q.shape[2], k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)  # the running merge's dtype
    out = q.new_empty(q.shape, dtype=acc)  # [Tq, H, D]
    lse = q.new_empty(q.shape[:2], dtype=acc)  # [Tq, H]
    for q0, count, n in plan.own_runs:
        a, rows = plan.own_offset + q0, slice(q0, q0 + count * n)
        qs = q[rows].view(count, n, heads, dim).transpose(1, 2)  # [g, H, n, D]
        ks = k[a:a + count * n].view(count, n, kv_heads, dim).transpose(1, 2)  # [g, Hkv, n, D]
        vs = v[a:a + count * n].view(count, n, kv_heads, dim).transpose(1, 2)
        o, l_ = block_lse(qs, ks, vs, causal=True, scale=scale)  # [g, H, n, D], [g, H, n]
        out[rows].view(count, n, heads, dim).copy_(o.transpose(1, 2))
        lse[rows].view(count, n, heads).copy_(l_.transpose(1, 2))
    for c in plan.shared:  # a call's rows are distinct: merged in place, a slice when contiguous
        ks, vs = k[c.k0:c.k1].transpose(0, 1)[None], v[c.k0:c.k1].transpose(0, 1)[None]
        nq = c.q1 - c.q0 if c.q_index is None else len(c.q_index)
        # NOTE: in pieces of SHARED_ROWS queries: a long input's rows against a short cached
        # prefix would otherwise hold a whole extra copy of its queries and partials at the peak
        for r0 in range(0, nq, SHARED_ROWS):
            r1 = min(nq, r0 + SHARED_ROWS)
            idx = None if c.q_index is None else c.q_index[r0:r1]
            qs = q[c.q0 + r0:c.q0 + r1] if idx is None else q.index_select(0, idx)  # [n, H, D]
            o, l_ = block_lse(qs.transpose(0, 1)[None], ks, vs, causal=False, scale=scale)
            o, l_ = o[0].transpose(0, 1), l_[0].transpose(0, 1)  # [n, H, D], [n, H]
            if idx is None:
                merge_two_(out[c.q0 + r0:c.q0 + r1], lse[c.q0 + r0:c.q0 + r1], o, l_)
            else:
                merged, new_lse = merge_two(out.index_select(0, idx), lse.index_select(0, idx), o, l_)
                out.index_put_((idx,), merged)
                lse.index_put_((idx,), new_lse)
    return out if out.dtype == q.dtype else out.to(q.dtype)


LseFn = Callable[..., tuple[Tensor, Tensor]]


def tree_varlen(lse_fn: LseFn) -> TreeFn:
    """The same decomposition as two varlen kernel calls and a merge (GPU).

    lse_fn(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale) -> (out [Tq, H, D], lse [Tq, H]).
    """
    def tree(q: Tensor, k: Tensor, v: Tensor, plan: TreePlan, *, scale: float) -> Tensor:
        a, z = plan.own_offset, plan.own_offset + q.shape[0]
        out, lse = lse_fn(q, k[a:z], v[a:z], plan.cu_own, plan.cu_own, plan.max_own, plan.max_own,
                          causal=True, scale=scale)
        if plan.part_rows is None:
            return out
        assert plan.shared_k_index is not None  # built with part_rows
        qs = q.index_select(0, plan.part_rows)  # [M, H, D]
        ks = k.index_select(0, plan.shared_k_index)  # [K, Hkv, D]: each segment once
        vs = v.index_select(0, plan.shared_k_index)
        o2, l2 = lse_fn(qs, ks, vs, plan.cu_shared_q, plan.cu_shared_k, plan.max_shared_q,
                        plan.max_shared_k, causal=False, scale=scale)
        return merge_into(out, lse, o2, l2, plan.part_rows)

    return tree


def attach_tree(forward, policy: str, fn: TreeFn | None, *, heads: int, kv_heads: int,
                head_dim: int):
    """The ForwardBatch with a tree plan when `policy` and the estimate say so, else unchanged.

    policy: "off" never, "on" every compact batch the planner accepts, "auto" where the estimate
    says the tree path is cheaper. Logs the choice at DEBUG with both estimates.
    """
    if policy == "off" or fn is None or forward.mode != "compact" or forward.kv_host is None:
        return forward
    cache = forward.cache
    n_read = int(cache.read_rows.shape[0]) if cache is not None and cache.read_rows is not None else 0
    attn = forward.attn
    plan = plan_tree(attn.host_cu_seqlens_q, attn.host_cu_seqlens_k, forward.kv_host,
                     own_offset=n_read, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     device=attn.cu_seqlens_q.device, force=policy == "on")
    if plan is None:
        log.debug("attention: flat (per-owner keys) for %d owners", len(attn.host_cu_seqlens_q) - 1)
        return forward
    log.debug("attention: tree, %d shared segments, %d own runs (estimated %.3g vs flat %.3g ms/layer)",
              len(plan.shared), len(plan.own_runs), plan.estimate[0] * 1e3, plan.estimate[1] * 1e3)
    return dataclasses.replace(forward, tree=TreeAttention(plan, fn))
