"""ForwardBatch: everything one ragged forward needs, built on the host before the model runs;
PreparedBatch: one ForwardBatch with the figures the scheduler reports about it (`Runner.prepare`).

Invariant: all index arithmetic happens on the host, in numpy, on the scheduler's CPU thread (here
and in the prefix cache's plan); the forward only reads tensors and Python ints (no
.item()/.tolist() on device tensors).
"Rows" are the rows the model runs on: N original tokens in mode "off", N' compact tokens in
"paper"/"compact". `last_rows`/`first_rows` index those rows.
With a prefix cache (compact mode only) the rows are the N' nodes minus those the cache's plan
(models/prefix_cache/layout.py) reads from the pool; each layer's keys come from
[pool rows read | new rows] and kv_index indexes that. This module only assembles batches: which
rows the pool serves is the cache's decision.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from models.attention.varlen import AttnMeta, make_meta
from models.lone_choice import Path as LonePath
from models.streams import to_device
from models.options import RADIX_ATTENTION
from models.prefix_cache import CacheIO, CachePlan, PrefixCache, cache_refusal, plan_batch
from models.trie import RadixIndex, identity_index, positions_from_cu_seqlens
from models.attention.tree import TreeAttention

MODES = ("off",) + RADIX_ATTENTION
LONE_LAYOUT_TOKENS = 256  # a lone CPU sequence up to this long reuses its length's layout (_lone_batch)


@dataclass(frozen=True)
class ForwardBatch:
    mode: str  # "off" | "paper" | "compact"
    input_ids: Tensor  # [T] int64, T = N (off) or N' (radix)
    positions: Tensor  # [T] int64
    attn: AttnMeta  # the attention call's boundaries (full sequences, or owners in compact)
    num_seqs: int  # B
    num_tokens: int  # N, original tokens
    seq_lens: tuple[int, ...]  # [B] original lengths, host
    last_rows: Tensor  # [B] int64 row of each sequence's last token
    first_rows: Tensor  # [B] int64 row of each sequence's first token
    scatter: Tensor | None  # paper: [N] int64 compact row of each original row (Q/K/V to N)
    gather: Tensor | None  # paper: [N'] int64 an original row of each compact row (output back)
    kv_index: Tensor | None  # [sum owner lengths] int64 compact rows of each owner's keys
    mean_weights: Tensor | None  # [B, T] sparse COO: multiplicity / length (mean pooling)
    cache: CacheIO | None = None  # pool reads/writes of this batch (compact mode with a cache)
    cached_tokens: tuple[int, ...] = ()  # [B] tokens of each sequence read from the cache
    # compact mode: kv_index on the host (the tree-attention planner reads it), and the batch's
    # tree plan when one is attached (models/attention/tree.py; None: per-owner key gather)
    kv_host: np.ndarray | None = None
    tree: TreeAttention | None = None

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def computed_tokens(self) -> tuple[int, ...]:
        """[B] tokens of each sequence not served by the prefix cache (len - cached)."""
        if not self.cached_tokens:
            return self.seq_lens
        return tuple(n - c for n, c in zip(self.seq_lens, self.cached_tokens))

    @property
    def cache_hit_tokens(self) -> int:
        return sum(self.cached_tokens)

    @property
    def cache_miss_tokens(self) -> int:
        """Tokens the cache did not serve (0 without a cache: nothing was looked up)."""
        return self.num_tokens - self.cache_hit_tokens if self.cache is not None else 0


def _mean_weights(rows: np.ndarray, lens: np.ndarray, num_rows: int,
                  device: torch.device) -> torch.Tensor:
    """Sparse [B, T] on `device`: 1/len_b at (b, row) for every original token of sequence b.

    Built coalesced on the host (sorted by (b, row)) and moved as two dense tensors, so a CUDA
    batch needs no blocking copy and no device-side coalesce.
    """
    seg = np.repeat(np.arange(len(lens), dtype=np.int64), lens)  # [N]
    vals = np.repeat(1.0 / np.maximum(lens, 1), lens).astype(np.float32)  # [N]
    # NOTE: a sequence never holds one compact row twice (positions differ), so there are no
    # duplicates; sorting is all coalescing needs (the index builder does not promise ascending
    # rows per sequence).
    order = np.lexsort((rows, seg))
    idx = torch.from_numpy(np.stack([seg[order], rows.astype(np.int64)[order]]))  # [2, N]
    return torch.sparse_coo_tensor(to_device(idx, device),
                                   to_device(torch.from_numpy(vals[order]), device),
                                   (len(lens), num_rows), check_invariants=False,
                                   is_coalesced=True)


def _checked(input_ids, cu_seqlens) -> tuple[np.ndarray, np.ndarray]:
    """(ids [N] int64, cu [B+1] int64) after checking they describe one ragged batch."""
    ids = np.asarray(input_ids).astype(np.int64, copy=False)
    cu = np.asarray(cu_seqlens).astype(np.int64, copy=False)
    lens = cu[1:] - cu[:-1]  # [B] (np.diff's own checks cost more than the subtraction)
    if ids.shape[0] != int(cu[-1]):
        raise ValueError(f"input_ids has {ids.shape[0]} tokens, cu_seqlens says {int(cu[-1])}")
    if len(lens) and np.minimum.reduce(lens) <= 0:  # the ufunc's reduce: not ndarray.min's Python wrapper
        raise ValueError("every sequence needs at least one token")
    return ids, cu


def build_forward_batch(input_ids, cu_seqlens, index: RadixIndex | None = None, *,
                        mode: str = "compact", device: torch.device | str = "cpu",
                        mean_pooling: bool = False, cache: PrefixCache | None = None,
                        namespaces=None) -> ForwardBatch:
    """Host-side builder. input_ids [N] int, cu_seqlens [B+1] int, index RadixIndex-shaped or None.

    With index=None the mode is "off" whatever `mode` says, unless a `cache` is given (compact
    mode only): then index=None means one node per token (no in-batch sharing), and the batch
    holds a lease on the cache that `cache.commit()`/`abort()` must settle (dropping the batch
    aborts it). namespaces: None, or [B] bytes, each sequence's prefix-cache namespace.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    device = torch.device(device)
    ids, cu = _checked(input_ids, cu_seqlens)
    n, b = int(cu[-1]), len(cu) - 1
    if cache is not None:
        refused = cache_refusal(radix_attention=mode, pooling="mean" if mean_pooling else "last-token")
        if refused is not None:
            raise ValueError(f"the prefix cache cannot serve this batch: {refused}")
        nodes = index if index is not None else identity_index(ids, cu)
        plan = plan_batch(cache, ids, cu, nodes, device, namespaces)
        try:
            return _build_cached(cu, nodes, plan, device)
        except BaseException:
            plan.io.abort()
            raise
    if index is None or mode == "off":
        if b == 1 and n <= LONE_LAYOUT_TOKENS and device.type == "cpu":
            return _lone_batch(ids, n, mean_pooling)
        return _plain_batch(ids, cu, device, mean_pooling)
    return _radix_batch(ids, cu, index, mode, device, mean_pooling)


def _lone_batch(ids: np.ndarray, n: int, mean_pooling: bool) -> ForwardBatch:
    """One sequence on the CPU: its ids in the layout every lone sequence of ``n`` tokens shares.

    The positions, boundaries, pooling rows and weights of a lone sequence depend on its length
    alone, and the forward only reads them, so they are built once per length (``_plain_batch``,
    so the layout is the general one by construction) and only the ids are new: a query's batch
    costs one tensor instead of some twenty small array and tensor operations, each slower than
    its arithmetic on caches the forward just flushed."""
    batch = object.__new__(ForwardBatch)
    batch.__dict__.update(_lone_layout(n, mean_pooling).__dict__)
    batch.__dict__["input_ids"] = torch.from_numpy(np.ascontiguousarray(ids))  # [N] (frozen: past __setattr__)
    return batch


@functools.lru_cache(maxsize=2 * LONE_LAYOUT_TOKENS)
def _lone_layout(n: int, mean_pooling: bool) -> ForwardBatch:
    return _plain_batch(np.zeros(n, dtype=np.int64), np.array([0, n], dtype=np.int64), torch.device("cpu"),
                        mean_pooling)


def _plain_batch(ids: np.ndarray, cu: np.ndarray, device: torch.device, mean_pooling: bool) -> ForwardBatch:
    """Mode "off": one model row per original token."""
    rows_of = np.arange(int(cu[-1]), dtype=np.int64)  # [N] model row of each original row
    return _assemble("off", ids, positions_from_cu_seqlens(cu, np.int64), rows_of, cu, cu, cu, device, mean_pooling)


def _radix_batch(ids: np.ndarray, cu: np.ndarray, index: RadixIndex, mode: str, device: torch.device,
                 mean_pooling: bool) -> ForwardBatch:
    """Modes "paper" and "compact": one model row per trie node."""
    row_ids = np.asarray(index.compact_ids).astype(np.int64)
    positions = np.asarray(index.compact_positions).astype(np.int64)
    rows_of = np.asarray(index.scatter).astype(np.int64)
    gather: np.ndarray | None = np.asarray(index.gather).astype(np.int64)
    scatter: np.ndarray | None = rows_of
    kv_index: np.ndarray | None = None
    if mode == "paper":
        cu_q = cu_k = cu
    else:
        cu_q = np.asarray(index.cu_seqlens_q).astype(np.int64)
        cu_k, kv_index = _owner_keys(rows_of, cu, np.asarray(index.owners).astype(np.int64))
        scatter = gather = None  # compact attention needs neither
    return _assemble(mode, row_ids, positions, rows_of, cu, cu_q, cu_k, device, mean_pooling,
                     scatter=scatter, gather=gather, kv_index=kv_index)


def _assemble(mode: str, row_ids: np.ndarray, positions: np.ndarray, rows_of: np.ndarray, cu: np.ndarray,
              cu_q: np.ndarray, cu_k: np.ndarray, device: torch.device, mean_pooling: bool, *,
              scatter: np.ndarray | None = None, gather: np.ndarray | None = None,
              kv_index: np.ndarray | None = None) -> ForwardBatch:
    """The ForwardBatch of host rows: row_ids/positions [T], rows_of [N] (each original token's
    row), cu [B+1] the original boundaries, cu_q/cu_k the attention call's."""
    lens = np.diff(cu)  # [B]
    n, b = int(cu[-1]), len(lens)
    last = rows_of[cu[1:] - 1] if b else np.zeros(0, np.int64)
    first = rows_of[cu[:-1]] if b else np.zeros(0, np.int64)
    weights = _mean_weights(rows_of, lens, len(row_ids), device) if mean_pooling else None
    return ForwardBatch(
        mode=mode, input_ids=_dev(row_ids, device), positions=_dev(positions, device),
        attn=make_meta(cu_q, cu_k, device), num_seqs=b, num_tokens=n,
        seq_lens=tuple(int(x) for x in lens), last_rows=_dev(last, device),
        first_rows=_dev(first, device), scatter=_opt_dev(scatter, device),
        gather=_opt_dev(gather, device), kv_index=_opt_dev(kv_index, device), mean_weights=weights,
        kv_host=kv_index,
    )


def _dev(a: np.ndarray, device: torch.device) -> Tensor:
    """[K] int64 host array -> device tensor (pinned, non-blocking on CUDA)."""
    return to_device(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)), device)


def _opt_dev(a: np.ndarray | None, device: torch.device) -> Tensor | None:
    return None if a is None else _dev(a, device)


def _owner_keys(rows_of: np.ndarray, cu: np.ndarray, owners: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cu_k [B'+1], kv_index [sum owner lengths]): compact attention's keys of each owner are its
    whole sequence, rows_of[cu[s]:cu[s+1]] for each owner s, concatenated without a Python loop."""
    if len(owners) == len(cu) - 1:  # every sequence owns rows: the keys are rows_of as it is
        return cu, rows_of
    owner_lens = np.diff(cu)[owners]
    cu_k = np.zeros(len(owners) + 1, dtype=np.int64)
    np.cumsum(owner_lens, out=cu_k[1:])
    starts = np.repeat(cu[owners] - cu_k[:-1], owner_lens)  # [sum owner lens]
    starts += np.arange(int(cu_k[-1]), dtype=np.int64)
    return cu_k, rows_of[starts]


def _build_cached(cu: np.ndarray, index: RadixIndex, plan: CachePlan,
                  device: torch.device) -> ForwardBatch:
    """Compact batch whose cached nodes (`plan.cached`) are read from the pool instead of computed:
    the rows are the other nodes, and every row index points into [pool rows read | new rows]."""
    lens = cu[1:] - cu[:-1]  # [B]
    b = len(lens)
    keep = ~plan.cached  # [N'] nodes this batch computes
    # [B] new rows each sequence owns: an owner's block is the suffix of its path of length
    # owned(s), and the cached nodes are a prefix of every path (plan.hits of them), so the
    # block's computed nodes are its last min(owned(s), len(s) - hits(s))
    owned = np.zeros(b, dtype=np.int64)
    cu_owned = np.asarray(index.cu_seqlens_q)  # [B'+1]
    owned[np.asarray(index.owners)] = cu_owned[1:] - cu_owned[:-1]
    n_computed = np.minimum(owned, lens - plan.hits)
    owners = np.flatnonzero(n_computed)  # ascending = compact order (owners come in batch order)
    cu_q = np.zeros(len(owners) + 1, dtype=np.int64)
    np.cumsum(n_computed[owners], out=cu_q[1:])
    src_of_row, n_read = plan.src_of_row, plan.n_read
    cu_k, kv_index = _owner_keys(src_of_row, cu, owners)
    # NOTE: a cached first token has no hidden row (-1 makes cls pooling fail loudly; the cache
    # serves last-token heads only, see cache_refusal); a node is cached iff its row < n_read.
    first = src_of_row[cu[:-1]] - n_read
    first[first < 0] = -1
    last = src_of_row[cu[1:] - 1] - n_read  # never cached: the plan keeps every pooled row computed
    return ForwardBatch(
        mode="compact", input_ids=_dev(np.asarray(index.compact_ids)[keep], device),
        positions=_dev(np.asarray(index.compact_positions)[keep], device),
        attn=make_meta(cu_q.tolist(), cu_k.tolist(), device), num_seqs=b, num_tokens=int(cu[-1]),
        seq_lens=tuple(lens.tolist()), last_rows=_dev(last, device),
        first_rows=_dev(first, device), scatter=None, gather=None, kv_index=_dev(kv_index, device),
        mean_weights=None, cache=plan.io, cached_tokens=tuple(plan.hits.tolist()), kv_host=kv_index,
    )


@dataclass(frozen=True)
class PreparedBatch:
    """One batch ready for `run`, and the figures the scheduler reports about it."""

    forward: ForwardBatch
    n_tokens: int  # N, original tokens
    n_compact: int  # rows the model runs on: N' with the trie, N without
    ratio: float  # N'/N of the trie (1.0 when it was not built)
    used_index: bool  # did the gate let the trie through
    computed_tokens: tuple[int, ...] = ()  # [B] tokens of each sequence not read from the prefix cache
    token_items: tuple[int, ...] = ()  # the all_tokens items, ascending: they answer [L, E] states
    token_rows: torch.Tensor | None = None  # [sum of their lengths] int64 model row of each of their tokens
    ready: torch.cuda.Event | None = None  # CUDA: recorded on the copy stream after this batch's copies
    # a lone short batch under `Runner.lone_choice`: the path it took (cache, threads), prepare's seconds
    lone: LonePath | None = None
    lone_prepare_s: float = 0.0
