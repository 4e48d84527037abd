"""The prefix cache a runner starts with: its size (explicit, or `auto` by the machine's rule), the
pool, and the report /info and the start-up log show (tokens, bytes, bytes per token, why).

Invariant: an explicit size that cannot be allocated fails at start (the pool is committed now);
`auto` on CUDA is measured after a forward of the largest batch (models/warmup.py `peak_forward`),
on a CPU taken from the RAM available (models/prefix_cache/size.py).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from models.prefix_cache import BLOCK_TOKENS, PrefixCache, bytes_per_token, cache_refusal, capacity_tokens
from models.prefix_cache.size import auto_device_tokens, auto_host_tokens, available_host_bytes, is_auto
from models.warmup import peak_forward

log = logging.getLogger("models.runner")  # the start-up lines of loading, under one logger


def head_pooling(kind: str, pooling: str) -> str:
    """The rows the head reads: every head but an embedding's scores each sequence's last token
    whatever `pooling`."""
    return pooling if kind == "embedding" else "last-token"


def start_prefix_cache(runner: Any, size, *, max_batch_tokens: int) -> tuple[PrefixCache | None, dict]:
    """The preallocated pool (or None) and /info's report of it: tokens, bytes and why.

    `auto` on CUDA runs a `max_batch_tokens` forward first and takes a share of what is free
    after it (models/prefix_cache/size.py); an explicit size too large fails here, at start.
    """
    cfg, device = runner.config, runner.device
    per_token = bytes_per_token(layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                                head_dim=cfg.head_dim, dtype=runner.dtype)
    refused = cache_refusal(radix_attention=runner.radix_attention, pooling=head_pooling(runner.kind, runner.pooling))
    if is_auto(size) and device.type == "cuda" and refused is None:
        peak = peak_forward(runner, max_batch_tokens)
        free, _ = torch.cuda.mem_get_info(device)
        tokens, why = auto_device_tokens(per_token, free, warmup_tokens=max_batch_tokens, peak=peak)
    elif is_auto(size):
        tokens, why = auto_host_tokens(per_token, available_host_bytes())
    else:
        tokens, why = capacity_tokens(size, per_token), f"--prefix-cache-size {size}"
        check_host_pool(tokens * per_token, device=device, size=size)
    off = None
    if tokens <= 0:
        off = "size 0"
    elif refused is not None:
        off = refused
    elif tokens < BLOCK_TOKENS:
        off = f"size {size!r} is under one {BLOCK_TOKENS}-token block ({per_token} bytes per token)"
    if off is not None:
        (log.info if tokens <= 0 else log.warning)("prefix cache off: %s", off)
        return None, {"tokens": 0, "bytes": 0, "bytes_per_token": per_token, "why": f"off: {off}"}
    cache = PrefixCache(layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                        head_dim=cfg.head_dim, capacity=tokens, dtype=runner.dtype, device=device)
    report = {"tokens": cache.n_slots * cache.block, "bytes": cache.capacity_bytes, "bytes_per_token": per_token,
              "why": why}
    log.info("prefix cache on: %d tokens, %.1f MiB (%d bytes per token); %s", report["tokens"],
             cache.capacity_bytes / 2**20, per_token, why)
    return cache, report


def check_host_pool(nbytes: int, *, device: torch.device, size) -> None:
    """Refuse at start a CPU pool larger than the RAM available now.

    NOTE: a CPU pool is allocated without touching its pages (models/prefix_cache/blocks.py), so
    the allocation itself would succeed and the process would run out of memory later, while
    serving; this check keeps "a pool too large fails at start" true on the CPU too.
    """
    if device.type != "cpu":
        return
    available = available_host_bytes()
    if nbytes > available:
        raise ValueError(f"--prefix-cache-size {size} needs {nbytes / 2**30:.2f} GiB, more than the "
                         f"{available / 2**30:.2f} GiB of RAM available: lower it (or use auto)")
