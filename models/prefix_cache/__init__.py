"""Cross-batch prefix cache: per-layer K/V rows of token blocks that earlier batches computed.

One package, one job each:
- `blocks`: the block radix tree, its eviction order and the preallocated K/V pool;
  `PrefixCache.plan` looks a batch up and leases what it reads and writes, `commit_later` (the
  worker: queued, published by the next plan), `commit` or `abort` settle the lease.
- `planner`: the steps of one `plan`, sequence by sequence (look-ups, partial match, writes).
- `lease`: the records, a cached `Block` and a batch's `Lease`.
- `siblings`: each parent's committed children sorted by token bytes (the partial look-up).
- `eviction`: the evictable leaves, least recently used first.
- `layout`: `cache_refusal`, the one rule for "may this batch use the cache", and `plan_batch`,
  a batch's one entry into the cache (look-up, then which trie nodes the pool serves and which
  rows it stores).
- `io`: `CacheIO`, what each attention layer reads from and writes to the pool.
- `size`: bytes per cached token and the `--prefix-cache-size` grammar.

Invariant: a hit is always the very same token prefix from position 0, and rows become readable
by other batches only after the batch that wrote them committed (see `blocks`).
"""
from __future__ import annotations

from models.prefix_cache.blocks import BLOCK_TOKENS, Lease, PrefixCache
from models.prefix_cache.io import CacheIO
from models.prefix_cache.layout import CachePlan, cache_refusal, plan_batch
from models.prefix_cache.size import DEFAULT_SIZE, bytes_per_token, capacity_tokens

__all__ = ["BLOCK_TOKENS", "DEFAULT_SIZE", "CacheIO", "CachePlan", "Lease", "PrefixCache",
           "bytes_per_token", "cache_refusal", "capacity_tokens", "plan_batch"]
