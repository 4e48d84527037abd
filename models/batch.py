"""ForwardBatch: everything one ragged forward needs, built on the host before the model runs.

Invariant: all index arithmetic happens here, in numpy, on the scheduler's CPU thread; the
forward only reads tensors and Python ints (no .item()/.tolist() on device tensors).
"Rows" are the rows the model runs on: N original tokens in mode "off", N' compact tokens in
"paper"/"compact". `last_rows`/`first_rows` index those rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from models.attention import AttnMeta, make_meta, to_device

MODES = ("off", "paper", "compact")


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

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])


def _positions(cu: np.ndarray) -> np.ndarray:
    lens = np.diff(cu)
    return (np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), lens))


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


def build_forward_batch(input_ids, cu_seqlens, index=None, *, mode: str = "compact",
                        device: torch.device | str = "cpu", mean_pooling: bool = False) -> ForwardBatch:
    """Host-side builder. input_ids [N] int, cu_seqlens [B+1] int, index RadixIndex-shaped or None.

    With index=None the mode is "off" whatever `mode` says.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    device = torch.device(device)
    ids = np.asarray(input_ids).astype(np.int64, copy=False)
    cu = np.asarray(cu_seqlens).astype(np.int64, copy=False)
    lens = np.diff(cu)
    n, b = int(cu[-1]), len(lens)
    if ids.shape[0] != n:
        raise ValueError(f"input_ids has {ids.shape[0]} tokens, cu_seqlens says {n}")
    if b and lens.min() <= 0:
        raise ValueError("every sequence needs at least one token")
    if index is None or mode == "off":
        mode = "off"
        row_ids, positions = ids, _positions(cu)
        rows_of = np.arange(n, dtype=np.int64)  # [N] model row of each original row
        cu_q = cu_k = cu
        scatter = gather = kv_index = None
    else:
        row_ids = np.asarray(index.compact_ids).astype(np.int64)
        positions = np.asarray(index.compact_positions).astype(np.int64)
        rows_of = np.asarray(index.scatter).astype(np.int64)
        gather = np.asarray(index.gather).astype(np.int64)
        scatter, kv_index = rows_of, None
        if mode == "paper":
            cu_q = cu_k = cu
        else:
            owners = np.asarray(index.owners).astype(np.int64)
            cu_q = np.asarray(index.cu_seqlens_q).astype(np.int64)
            owner_lens = lens[owners]
            cu_k = np.concatenate([[0], np.cumsum(owner_lens)])
            # kv_index = concat of scatter[cu[s]:cu[s+1]] over owners s, without a Python loop.
            starts = np.repeat(cu[owners] - cu_k[:-1], owner_lens)  # [sum owner lens]
            kv_index = rows_of[np.arange(int(cu_k[-1]), dtype=np.int64) + starts]
            scatter = gather = None  # compact attention needs neither
    last = rows_of[cu[1:] - 1] if b else np.zeros(0, np.int64)
    first = rows_of[cu[:-1]] if b else np.zeros(0, np.int64)

    def dev(a: np.ndarray | None, dtype=torch.int64):
        if a is None:
            return None
        return to_device(torch.from_numpy(np.ascontiguousarray(a)).to(dtype), device)

    attn = make_meta(cu_q, cu_k, device)
    weights = _mean_weights(rows_of, lens, len(row_ids), device) if mean_pooling else None
    return ForwardBatch(
        mode=mode, input_ids=dev(row_ids), positions=dev(positions), attn=attn, num_seqs=b,
        num_tokens=n, seq_lens=tuple(int(x) for x in lens), last_rows=dev(last),
        first_rows=dev(first), scatter=dev(scatter), gather=dev(gather), kv_index=dev(kv_index),
        mean_weights=weights,
    )
