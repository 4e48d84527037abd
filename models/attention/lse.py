"""Attention over one key block with its log-sum-exp, and the exact merge of such partials.

Invariant: softmax attention over keys K = K1 ∪ K2 equals the merge of the attention over K1 and
over K2 weighted by exp(lse_i - lse), lse = log(exp(lse_1) + exp(lse_2)); so a query's keys can
be split into blocks (a shared prefix without a mask, its own tokens causally) and nothing is
approximated. The CPU kernels used here (aten's flash attention for the CPU, or for large blocks
the oneDNN tiles of ``models.attention.tiles`` where ``select_cpu_kernel`` measured them faster
at load) tile queries and keys, so memory stays O(rows x keys-per-tile): no [Lq, Lk] mask or
score matrix is ever built, and where the flash kernel takes fewer K/V heads than query heads
(checked once, ``flash_takes_gqa``) K/V are never repeated per query head either.

NOTE: the kernel's log-sum-exp output has no gradient, so these pieces serve inference only;
callers take their masked, differentiable path when autograd needs the result (``needs_grad``).
"""
from __future__ import annotations

import functools
import logging
import math
import time

import torch
from torch import Tensor

from models import measure_cache
from models.attention import tiles as attention_tiles
log = logging.getLogger(__name__)

_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def needs_grad(*tensors: Tensor) -> bool:
    """True when autograd records through any of `tensors` (the LSE merge is inference-only)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


@functools.cache
def flash_takes_gqa() -> bool:
    """True when the CPU flash kernel broadcasts K/V heads to query-head groups by itself (query
    head h reads K/V head h // group), checked once against the repeated K/V on a tiny case."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=gen)  # [g, H, L, D]
    k, v = torch.randn(2, 2, 2, 5, 8, generator=gen)  # [g, Hkv, L, D] each
    try:
        got = _CPU_FLASH(q, k, v, 0.0, True, scale=0.3)[0]
    except RuntimeError:
        return False
    want = _CPU_FLASH(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), 0.0, True,
                      scale=0.3)[0]
    return got.shape == want.shape and torch.allclose(got, want, atol=1e-6)


def block_lse(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """q [g, H, Lq, D], k/v [g, Hkv, Lk, D] -> (out [g, H, Lq, D], lse [g, H, Lq] float32).

    causal: query i sees keys j <= i (Lq == Lk, the diagonal block). Without it every query sees
    every key, and with fewer K/V heads the query heads of one group are folded into the query
    axis ([g, Hkv, group*Lq, D]) so K/V are never repeated; the causal block hands the kernel
    the K/V heads as they are where it broadcasts them itself (``flash_takes_gqa``), else
    repeats them (its keys are the block's own rows, as many as its queries).
    """
    if attention_tiles.use_tiles(q, k, causal=causal):
        return attention_tiles.tiled_lse(q, k, v, causal=causal, scale=scale)
    return flash_lse(q, k, v, causal=causal, scale=scale)


def flash_lse(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """block_lse through aten's CPU flash kernel, whatever the block's size."""
    g, heads, lq, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    if group > 1 and not causal:
        qf = q.reshape(g, kv_heads, group * lq, dim)  # [g, Hkv, group*Lq, D] (heads are kv-major)
        out, lse = _CPU_FLASH(qf, k, v, 0.0, False, scale=scale)
        return out.reshape(g, heads, lq, dim), lse.reshape(g, heads, lq)
    if group > 1 and not flash_takes_gqa():
        k = k.repeat_interleave(group, dim=1)  # [g, H, Lk, D]
        v = v.repeat_interleave(group, dim=1)
    return _CPU_FLASH(q, k, v, 0.0, causal, scale=scale)


MIN_GAIN = 1.1  # tiles must beat the flash kernel by this much at load, or it stays


def select_cpu_kernel(wanted: bool, *, heads: int, kv_heads: int, head_dim: int) -> str:
    """Choose, for this process, whether large CPU blocks run as oneDNN tiles; say which and why.

    Tiles serve only after they matched a float64 reference in the model's head layout and
    measured at least ``MIN_GAIN`` times faster than the flash kernel at this process's thread
    count, on blocks of the size tiles serve (``_measure``); anything else keeps the flash
    kernel. NOTE: a measurement on a busy machine can go either way near the threshold; the
    start-up log and /info's ``cpu_attention`` say what was measured and chosen.
    """
    attention_tiles.set_enabled(False)
    if not wanted:
        return "flash (cpu_packed_weights off)"
    if not torch.backends.mkldnn.is_available():
        return "flash (this torch build has no oneDNN)"
    threads = torch.get_num_threads()
    try:
        gain = _measure(heads, kv_heads, head_dim, threads)
    except (AssertionError, RuntimeError) as e:
        return f"flash (oneDNN tiles failed their self-test: {e})"
    if gain < MIN_GAIN:
        return f"flash (oneDNN tiles ran {gain:.2f}x its speed at {threads} threads)"
    attention_tiles.set_enabled(True)
    return f"onednn-tiles for large blocks ({gain:.2f}x the flash kernel at {threads} threads)"


@functools.cache
def _measure(heads: int, kv_heads: int, head_dim: int, threads: int) -> float:
    """`_time_tiles`'s gain, read from the measurement cache when this machine, torch, thread
    count, shape and kernel code measured it before (models/measure_cache.py)."""
    entry = measure_cache.key("cpu-attention-tiles", modules=("models.attention.tiles", "models.attention.lse"),
                              dtype=torch.float32, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                              threads=threads)
    cached = measure_cache.lookup(entry)
    if isinstance(cached, float) and cached > 0:
        log.info("CPU attention tiles: %.2fx the flash kernel, from the measurement cache", cached)
        return cached
    gain = _time_tiles(heads, kv_heads, head_dim)
    measure_cache.store(entry, gain)
    return gain


def _time_tiles(heads: int, kv_heads: int, head_dim: int) -> float:
    """flash time / tiles time (best of 3, alternating) over a causal 2048-row block and 2048
    queries x 2048 keys. The smallest blocks tiles serve are about the causal one's size, where
    the gain is smaller and varies more than on big blocks: the pair is steadier than the
    smallest alone. First the tiles must match the flash kernel run in float64 on a causal
    600-row block and 130 x 700 keys (every kind of tile: full, diagonal, tail, padded rows);
    AssertionError on a mismatch (nothing is cached then)."""
    gen = torch.Generator().manual_seed(0)

    def block(lq: int, lk: int) -> tuple[Tensor, Tensor, Tensor]:
        q = torch.randn(1, heads, lq, head_dim, generator=gen)
        k, v = torch.randn(2, 1, kv_heads, lk, head_dim, generator=gen)
        return q, k, v

    scale = 1.0 / math.sqrt(head_dim)
    with torch.inference_mode():
        for lq, lk, causal in ((600, 600, True), (130, 700, False)):
            q, k, v = block(lq, lk)
            got, got_lse = attention_tiles.tiled_lse(q, k, v, causal=causal, scale=scale)
            want, want_lse = flash_lse(q.double(), k.double(), v.double(), causal=causal, scale=scale)
            err = max(float((got.double() - want).abs().max()),
                      float((got_lse.double() - want_lse).abs().max()))
            assert err <= 1e-4, f"max error {err:.2e} against float64"
        cases = [(*block(2048, 2048), True), (*block(2048, 2048), False)]
        best = {"flash": math.inf, "tiles": math.inf}
        for _ in range(3):
            for name, fn in (("flash", flash_lse), ("tiles", attention_tiles.tiled_lse)):
                t0 = time.perf_counter()
                for q, k, v, causal in cases:
                    fn(q, k, v, causal=causal, scale=scale)
                best[name] = min(best[name], time.perf_counter() - t0)
    return best["flash"] / best["tiles"]


def _acc(t: Tensor) -> torch.dtype:
    """The merge's dtype: float32, or float64 for float64 inputs (the probes' reference)."""
    return torch.promote_types(t.dtype, torch.float32)


def merge_two(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """Exact merge of two partials over disjoint key sets: o [..., L, D], lse [..., L] ->
    (out in o1's dtype, its lse). NOTE: the weights are exp(lse_i - max), so nothing overflows;
    out = o1 + (o2 - o1) * w2 / (w1 + w2) is one pass (lerp)."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - m).exp(), (lse2 - m).exp()
    total = w1 + w2
    acc = _acc(o1)
    out = torch.lerp(o1.to(acc), o2.to(acc), (w2 / total).unsqueeze(-1))
    return out.to(o1.dtype), m + total.log()


def merge_two_(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> None:
    """merge_two in place into (o1, lse1), e.g. slices of a running accumulator (o1's dtype)."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - m).exp(), (lse2 - m).exp()
    total = w1 + w2
    o1.lerp_(o2.to(o1.dtype), (w2 / total).unsqueeze(-1))
    lse1.copy_(m + total.log())


def merge_into(out: Tensor, lse: Tensor, parts: Tensor, parts_lse: Tensor, rows: Tensor) -> Tensor:
    """out [T, H, D] with lse [T, H] (every row's own partial), merged exactly with the extra
    partials parts [M, H, D] / parts_lse [M, H] of rows `rows` [M] (a row may have several)."""
    m = lse.scatter_reduce(0, rows[:, None].expand_as(parts_lse), parts_lse, "amax")  # [T, H] row maxima
    w_own = (lse - m).exp()  # [T, H]
    w_parts = (parts_lse - m.index_select(0, rows)).exp()  # [M, H]
    acc = _acc(out)
    num = (out.to(acc) * w_own.unsqueeze(-1)).index_add_(0, rows, parts.to(acc) * w_parts.unsqueeze(-1))
    den = w_own.index_add(0, rows, w_parts)  # [T, H]
    return (num / den.unsqueeze(-1)).to(out.dtype)
