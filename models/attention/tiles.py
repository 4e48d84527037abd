"""Attention over one key block in fixed-size oneDNN GEMM tiles, with its log-sum-exp (CPU fp32).

Why: aten's CPU flash kernel multiplies through the BLAS sgemm, and on CPUs where that sgemm is
not the fastest GEMM the process has, attention runs well below the linears. Where MKL's sgemm is
slower than oneDNN's matmul (the one behind the packed linears), a large attention block in
128 x 512 tiles through oneDNN beats the flash kernel. Where it is not (an Intel CPU whose MKL
takes its AVX-512 path), the flash kernel is as fast, so ``select_cpu_kernel`` (lse.py)
measures both at load and keeps the flash kernel unless tiles win (docs/decisions.md, "CPU
attention tiles, chosen at load").

Contract: ``tiled_lse(q, k, v, causal=, scale=)`` returns what ``block_lse`` (lse.py) returns,
(out [g, H, Lq, D], lse [g, H, Lq] float32), equal up to fp32 summation order. Queries go in
tiles of ``TILE_Q`` per head, the heads of one K/V group folded into the GEMM's rows; keys in
tiles of ``TILE_K`` wherever every query of the tile sees every key of it, else in tiles of
``TILE_Q`` (the causal diagonal, the tail), masked there only. Tiles are merged exactly by their
running max and sum (online softmax). Fixed tile shapes mean four oneDNN primitives per model
(no per-shape cache growth). Memory beyond the output: per worker, one (sequence, K/V head)
item's Q, K and V in tile layout (O(rows + keys), never O(rows x keys)) and one tile's scores,
O(tile rows x TILE_K).

NOTE: inference only; ``use_tiles`` says no under autograd, off the CPU, outside float32, and
for blocks too small to fill their tiles, where the flash kernel is as fast or faster
(a 128-row causal block is mostly padding and mask as a tile).
"""
from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
from torch import Tensor

TILE_Q = 128  # query rows per head in one tile
TILE_K = 512  # keys in one unmasked tile (a multiple of TILE_Q)
# Blocks with fewer (query row x key) pairs per K/V head, the group's heads folded in, stay on
# the flash kernel: the gain grows with the block, and at two threads a 128 x 2048 block ran
# slower as tiles (`python -m benchmarks.bench_tiles --threads 2 --clock wall`; docs/decisions.md,
# "CPU attention tiles, chosen at load").
MIN_PAIRS = 1 << 22
_NEG = float("-inf")
# Process-wide, like the kernel itself: set once at load (lse.select_cpu_kernel)
_state = {"on": False}


def set_enabled(on: bool) -> None:
    """Let ``use_tiles`` choose tiles (True) or keep every block on the flash kernel."""
    _state["on"] = bool(on)


def _mm_t(x: Tensor, w: Tensor) -> Tensor:
    """x [M, K] @ w[N, K].T -> [M, N] through oneDNN's linear. NOTE: w must be contiguous: a
    strided weight takes a path orders of magnitude slower."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def key_tiles(q0: int, q1: int, lk: int, causal: bool) -> list[tuple[int, int]]:
    """(start, size) of the key tiles that query rows [q0, q1) read: TILE_K tiles while every
    query sees all their keys, then TILE_Q tiles up to the last key any of them sees."""
    end = q1 if causal else lk
    unmasked = q0 if causal else lk
    tiles, c = [], 0
    while c + TILE_K <= unmasked:
        tiles.append((c, TILE_K))
        c += TILE_K
    while c < end:
        tiles.append((c, TILE_Q))
        c += TILE_Q
    return tiles


def use_tiles(q: Tensor, k: Tensor, *, causal: bool) -> bool:
    """True when ``tiled_lse`` should serve this block: enabled at load, CPU float32 without
    autograd, and big enough that its tiles are mostly full."""
    if not _state["on"] or q.device.type != "cpu" or q.dtype != torch.float32:
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return False
    lq, lk, group = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    if causal:
        return lq >= TILE_K and group * lq * (lq + 1) // 2 >= MIN_PAIRS
    return lk >= TILE_K and lq >= TILE_Q and group * lq * lk >= MIN_PAIRS


def tiled_lse(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """q [g, H, Lq, D], k/v [g, Hkv, Lk, D] -> (out [g, H, Lq, D], lse [g, H, Lq] float32).

    causal: query i sees keys j <= i (Lq == Lk). Query heads h of K/V head h // group. With more
    than one torch thread, the (sequence, K/V head) items run on that many worker threads of one
    torch thread each (``_pool``): a tile's GEMMs are too small to split across threads."""
    g, heads, lq, dim = q.shape
    kv_heads, lk = k.shape[1], k.shape[2]
    group = heads // kv_heads
    nq, tq = -(-lq // TILE_Q), TILE_Q
    nk_small, nk_big = -(-lk // tq), lk // TILE_K
    out = q.new_empty(g, kv_heads, group, lq, dim)  # [g, H, Lq, D] once the heads are merged
    lse = torch.empty(g, kv_heads, group, lq)
    diag = torch.ones(tq, tq, dtype=torch.bool).triu_(1) if causal else None  # [tq, tq]

    def item(b: int, h: int) -> None:
        # NOTE: one item's tile layouts at a time (a long input's whole block would be hundreds
        # of MiB more at the peak), each one allocation filled in place
        with torch.inference_mode():  # a worker thread does not inherit the caller's mode
            qp = _tiled(q[b, h * group:(h + 1) * group], nq, tq)  # [nq, group, tq, D]
            qp.mul_(scale)
            kp = k.new_zeros(nk_small * tq, dim)  # [keys padded to tq, D]
            kp[:lk].copy_(k[b, h])
            # V as [D, tile] blocks, the weight layout of the second GEMM: [n, D, tile]
            v_small = _tiled(v[b, h].t(), nk_small, tq)
            v_big = v[b, h, :nk_big * TILE_K].unflatten(0, (nk_big, TILE_K)).transpose(1, 2).contiguous()
            for t in range(nq):
                n = min(lq, t * tq + tq) - t * tq  # the tile's real rows
                o, m, s = _one_tile(qp[t].view(group * tq, dim), kp, v_small, v_big,
                                    key_tiles(t * tq, t * tq + n, lk, causal),
                                    lk=lk, diag=diag, group=group)
                o3, m3, s3 = o.view(group, tq, dim), m.view(group, tq), s.view(group, tq)
                torch.div(o3[:, :n], s3[:, :n, None], out=out[b, h, :, t * tq:t * tq + n])
                torch.add(m3[:, :n], s3[:, :n].log(), out=lse[b, h, :, t * tq:t * tq + n])

    _run_items(item, [(b, h) for b in range(g) for h in range(kv_heads)])
    return out.view(g, heads, lq, dim), lse.view(g, heads, lq)


def _tiled(x: Tensor, n: int, size: int) -> Tensor:
    """x [A, L, ...] split along L into `n` zero-padded tiles of `size`, in one new contiguous
    tensor [n, A, size, ...]: for queries A is the group's heads, for V laid out [D, L] it is D
    (then each tile is a [D, size] GEMM weight)."""
    full, rest = divmod(x.shape[1], size)
    t = x.new_zeros(n, x.shape[0], size, *x.shape[2:])
    if full:
        t[:full].copy_(x.narrow(1, 0, full * size).unflatten(1, (full, size)).transpose(0, 1))
    if rest:
        t[full].narrow(1, 0, rest).copy_(x.narrow(1, full * size, rest))
    return t


def _run_items(fn: Callable[[int, int], None], items: list[tuple[int, int]]) -> None:
    """fn(*item) for every item: inline with one torch thread, else spread over the pool."""
    threads = torch.get_num_threads()
    if threads <= 1 or len(items) == 1:
        for it in items:
            fn(*it)
        return
    pool = _pool(threads)
    for f in [pool.submit(fn, *it) for it in items]:
        f.result()  # re-raises a worker's error here


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    """`threads` workers, each with one torch (OpenMP) thread: their own setting, the caller's
    stays as it is."""
    return ThreadPoolExecutor(threads, thread_name_prefix="attn-tiles",
                              initializer=torch.set_num_threads, initargs=(1,))


def _one_tile(x: Tensor, k: Tensor, v_small: Tensor, v_big: Tensor, tiles: list[tuple[int, int]],
              *, lk: int, diag: Tensor | None, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """One query tile x [group*tq, D] over its key tiles -> (unnormalised out [rows, D], running
    max [rows, 1], running sum [rows, 1]). Every row sees at least one key of every tile.

    diag: the causal mask [tq, tq]; the last tile is then the diagonal one (it starts at the
    query tile's first row)."""
    last = len(tiles) - 1

    def partial(i: int) -> tuple[Tensor, Tensor, Tensor]:
        c0, size = tiles[i]
        sc = _mm_t(x, k[c0:c0 + size])  # [rows, size] scores (q already scaled)
        if diag is not None and i == last:
            sc.view(group, TILE_Q, size).masked_fill_(diag, _NEG)  # [group, tq, tq]
        elif c0 + size > lk:
            sc[:, lk - c0:] = _NEG  # keys past the block's end (padding)
        mt = sc.amax(-1, keepdim=True)
        sc.sub_(mt).exp_()
        vt = v_big[c0 // TILE_K] if size == TILE_K else v_small[c0 // TILE_Q]  # [D, size]
        return _mm_t(sc, vt), mt, sc.sum(-1, keepdim=True)  # [rows, D], [rows, 1], [rows, 1]

    o, m, s = partial(0)
    for i in range(1, len(tiles)):
        ot, mt, st = partial(i)
        mn = torch.maximum(m, mt)
        a, b = (m - mn).exp_(), (mt - mn).exp_()
        o.mul_(a).add_(ot.mul_(b))
        s = s * a + st * b
        m = mn
    return o, m, s
