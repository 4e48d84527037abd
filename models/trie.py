"""In-batch prefix trie: which rows of a ragged batch share their whole causal history.

A row is identified by its sequence's prefix up to and including it, as (token, position) pairs:
node identity = (parent node, token id, position). Rows with the same node have identical hidden
states at every layer, so the model runs once per node (one *compact* row).

Invariant that compact attention relies on: a node is owned by the first sequence (in batch order)
that contains it, so the rows a sequence owns are exactly a suffix of it (if it owns depth d, no
earlier sequence contains its prefix to d, hence none contains any longer prefix either). Compact
rows are ordered by the original row of their owner, so each owner's block is contiguous and in
position order, and owners appear in batch order.

Everything is vectorized numpy, linear in the batch apart from sorting the B sequences (rows of a
padded grid compared as big-endian bytes): adjacent longest-common-prefixes mark where nodes
start, a column-major running count numbers them and a segmented minimum finds their owners.
Batches whose padded grid would be much larger than the batch use prefix doubling instead
(log2(max length) sorts of the rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_MAX_VALUE = 2**31  # ids and positions must fit int32 outputs; also keeps the packed key < 2**62
# Pad the sequences into a [B, Lmax] grid only while it stays within this many cells.
_PAD_FACTOR = 4
_PAD_SLACK = 1 << 16


@dataclass(frozen=True)
class RadixIndex:
    """The compact layout of one batch (see docs/design.md, "RadixIndex contract")."""

    compact_ids: np.ndarray  # [N'] int32 token id of each unique node
    compact_positions: np.ndarray  # [N'] int32 position of each unique node
    gather: np.ndarray  # [N'] int32 an original row holding each node (its owner's row)
    scatter: np.ndarray  # [N] int32 compact row of each original row
    owners: np.ndarray  # [B'] int32 sequences owning at least one node, in compact order
    cu_seqlens_q: np.ndarray  # [B'+1] int32 boundaries of each owner's block of compact rows
    ratio: float  # N' / N (1.0 for an empty batch)


def positions_from_cu_seqlens(cu_seqlens, dtype: type = np.int32) -> np.ndarray:
    """[N] `dtype` (int32 unless asked): 0..len-1 for each sequence of the ragged batch."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lens = np.diff(cu)
    n = int(cu[-1]) if cu.size else 0
    return (np.arange(n, dtype=np.int64) - np.repeat(cu[:-1], lens)).astype(dtype, copy=False)


def identity_index(input_ids, cu_seqlens) -> RadixIndex:
    """The layout without sharing: one node per token, each sequence owning all of its rows (a
    batch the trie gate leaves out but that still runs compact, e.g. to use the prefix cache)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    n, b = int(cu[-1]), len(cu) - 1
    rows = np.arange(n, dtype=np.int32)
    return RadixIndex(
        compact_ids=np.asarray(input_ids).astype(np.int32), compact_positions=positions_from_cu_seqlens(cu),
        gather=rows, scatter=rows, owners=np.arange(b, dtype=np.int32), cu_seqlens_q=cu.astype(np.int32),
        ratio=1.0,
    )


def _validate(input_ids, position_ids, cu_seqlens):
    ids = np.asarray(input_ids)
    pos = np.asarray(position_ids)
    cu = np.asarray(cu_seqlens)
    for name, arr in (("input_ids", ids), ("position_ids", pos), ("cu_seqlens", cu)):
        if arr.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if ids.shape != pos.shape:
        raise ValueError(
            f"input_ids and position_ids must have the same length, got {ids.size} and {pos.size}"
        )
    if cu.size == 0:
        raise ValueError("cu_seqlens must have at least one entry (0)")
    cu = cu.astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
    if np.any(np.diff(cu) < 0):
        raise ValueError("cu_seqlens must be non-decreasing")
    if cu[-1] != ids.size:
        raise ValueError(f"cu_seqlens must end at len(input_ids)={ids.size}, got {cu[-1]}")
    ids = ids.astype(np.int64)
    pos = pos.astype(np.int64)
    for name, arr in (("input_ids", ids), ("position_ids", pos)):
        if arr.size and (arr.min() < 0 or arr.max() >= _MAX_VALUE):
            raise ValueError(f"{name} must lie in [0, 2**31)")
    return ids, pos, cu


def _layout_padded(sym, lens, cu):
    """(gather, scatter, owned count per sequence) via a lexicographic sort of padded sequences."""
    b, lmax = lens.size, int(lens.max())
    col = np.arange(lmax)
    in_batch = col[None, :] < lens[:, None]  # [B, L] real cells, sequences in batch order
    # NOTE: keys are stored big-endian so that a bytewise (memcmp) comparison of whole rows, which
    # is what sorting the void view does, is the lexicographic order of the sequences; 0 is the
    # padding and sorts before every real symbol, so a prefix sorts before its extensions.
    grid = np.zeros((b, lmax), dtype=np.int64)  # [B, L]
    grid[in_batch] = sym.astype(">i8").view(np.int64)
    order = np.argsort(grid.view(f"V{8 * lmax}").ravel(), kind="stable")  # rank -> sequence
    rank = np.empty(b, dtype=np.int64)
    rank[order] = np.arange(b)
    g = grid[order]  # [B, L] sequences in lexicographic order
    diff = g[1:] != g[:-1]  # [B-1, L]
    lcp = np.zeros(b, dtype=np.int64)  # common prefix with the previous sequence in sorted order
    lcp[1:] = np.where(diff.any(axis=1), diff.argmax(axis=1), lmax)
    # Within one depth column, in sorted order, the sequences sharing a node are a run of
    # consecutive ranks, and a cell starts a new run iff it does not share the previous sorted
    # sequence's prefix through that depth. So in column-major order every node is one run of
    # cells (padding only after its last real cell) and a running count numbers the nodes.
    valid_t = col[:, None] < lens[order][None, :]  # [L, B] real cells, column-major rank order
    new_t = ((col[:, None] >= lcp[None, :]) & valid_t).ravel()  # [L*B]
    starts = np.flatnonzero(new_t)  # [N'] first cell of each node
    # [L*B] sequence of each cell, b on padding (never a run's minimum: each run has a real cell)
    seq_t = np.where(valid_t, order.astype(np.int32)[None, :], b).ravel()
    owner = np.minimum.reduceat(seq_t, starts)  # [N'] first sequence (batch order) with the node
    n_owned = np.bincount(owner, minlength=b)  # [B]
    own_start = lens - n_owned  # owned rows are the suffix from here
    block = np.zeros(b, dtype=np.int64)  # first compact row of each sequence's block
    np.cumsum(n_owned[:-1], out=block[1:])
    compact = (block[owner] + starts // b - own_start[owner]).astype(np.int32)  # [N'] per node
    # [L*B] node of each cell; padding cells take a neighbour's value and are never read
    node_of_cell = np.cumsum(new_t, dtype=np.int32) - 1
    # NOTE: one transposing copy back to row-major; int32 halves its memory traffic
    compact_cells = np.ascontiguousarray(compact[node_of_cell].reshape(lmax, b).T)  # [B, L]
    scatter = compact_cells[rank]  # [B, L] sequences in batch order
    scatter = scatter.ravel() if lens.min() == lmax else scatter[in_batch]  # [N]
    gather = np.arange(compact.size) + np.repeat(cu[:-1] + own_start - block, n_owned)
    return gather, scatter, n_owned


def _nodes_doubling(sym, depth) -> np.ndarray:
    """Node id of each row by prefix doubling, for batches too ragged to pad.

    After round k a row's id names the string of its last 2**k symbols (fewer at the start of a
    sequence); a window longer than 2**k is (id of the part before, id of the last 2**k), and a
    shorter one keeps its id with a -1 partner, so ids stay in bijection with strings.
    """
    n = sym.size
    _, node = np.unique(sym, return_inverse=True)
    rows = np.arange(n)
    step, lmax = 1, int(depth.max()) + 1
    while step < lmax:
        prev = np.where(depth >= step, node[np.maximum(rows - step, 0)], -1)
        _, node = np.unique((prev + 1) * (n + 1) + node, return_inverse=True)
        step *= 2
    return node.reshape(-1)


def _layout_doubling(sym, lens, cu):
    """(gather, scatter, owned count per sequence) from per-row node ids (prefix doubling)."""
    n = sym.size
    seq = np.repeat(np.arange(lens.size), lens)  # [N] sequence of each row
    depth = positions_from_cu_seqlens(cu, np.int64)  # [N] index of each row in its sequence
    node = _nodes_doubling(sym, depth)
    rows = np.arange(n)
    n_nodes = int(node.max()) + 1
    first = np.full(n_nodes, n, dtype=np.int64)
    np.minimum.at(first, node, rows)  # first row (batch order) of each node: its owner's row
    gather = np.flatnonzero(first[node] == rows)  # [N'] ascending: owners in order, blocks sorted
    compact_of_node = np.empty(n_nodes, dtype=np.int64)
    compact_of_node[node[gather]] = np.arange(n_nodes)
    return gather, compact_of_node[node], np.bincount(seq[gather], minlength=lens.size)


def build_index(input_ids, position_ids, cu_seqlens, *, groups=None) -> RadixIndex:
    """Deduplicate the rows of a ragged batch that share their whole prefix (see module doc).

    groups: None, or [B] ints in [0, 2**30): sequences of different groups never share a node
    (0 is the shared group; e.g. prefix-cache namespaces, so that a batch's compute does not
    depend on what another namespace sent).
    """
    ids, pos, cu = _validate(input_ids, position_ids, cu_seqlens)
    n = ids.size
    if n == 0:
        empty = np.zeros(0, dtype=np.int32)
        return RadixIndex(empty, empty, empty, empty, empty, np.zeros(1, np.int32), 1.0)
    lens = np.diff(cu)
    sym = ((ids << 31) | pos) + 1  # [N] one int64 per (token, position), in [1, 2**62]
    if groups is not None:
        g = np.asarray(groups, dtype=np.int64)  # [B]
        if g.shape != lens.shape or (g.size and (g.min() < 0 or g.max() >= 1 << 30)):
            raise ValueError(f"groups must be [B] ints in [0, 2**30), got shape {g.shape}")
        first = cu[:-1][g > 0]  # first row of each sequence in a group of its own
        # above every (token, position) key: a grouped sequence's root row matches only its group's
        sym[first] = ((1 << 62) | (g[g > 0] << 31) | ids[first]) + 1
    if lens.size * int(lens.max()) <= _PAD_FACTOR * n + _PAD_SLACK:
        gather, scatter, n_owned = _layout_padded(sym, lens, cu)
    else:
        gather, scatter, n_owned = _layout_doubling(sym, lens, cu)
    owners = np.flatnonzero(n_owned)
    cu_q = np.zeros(owners.size + 1, dtype=np.int64)
    np.cumsum(n_owned[owners], out=cu_q[1:])
    return RadixIndex(
        compact_ids=ids[gather].astype(np.int32),
        compact_positions=pos[gather].astype(np.int32),
        gather=gather.astype(np.int32),
        scatter=scatter.astype(np.int32),
        owners=owners.astype(np.int32),
        cu_seqlens_q=cu_q.astype(np.int32),
        ratio=gather.size / n,
    )


def namespace_groups(namespaces) -> np.ndarray | None:
    """[B] int64 group of each item for the trie: 0 for the shared namespace (b""), 1.. for the
    others in order of first appearance; None when every item is in the shared one."""
    if namespaces is None or not any(namespaces):
        return None
    ranks: dict[bytes, int] = {b"": 0}
    return np.fromiter((ranks.setdefault(ns, len(ranks)) for ns in namespaces), dtype=np.int64,
                       count=len(namespaces))
