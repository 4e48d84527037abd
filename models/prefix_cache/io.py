"""One batch's reads from and writes to the prefix cache's pool, layer by layer, in the forward.

Invariant: every index here was computed on the host before the forward (models/prefix_cache/
layout.py); a layer only gathers, concatenates and copies. Rows are written before the batch's
lease is committed, and a lease is committed only after the whole forward succeeded (on a CPU:
it returned; on CUDA: it is queued on the stream every later batch runs on), so no other batch can
read a row this one has not finished writing. `commit` only queues the lease (O(1), the model
worker's thread); the prep thread publishes it before its next look-up (`PrefixCache.plan`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from models.prefix_cache.blocks import Lease, PrefixCache

if TYPE_CHECKING:
    from kernels import GatherPairFn


@dataclass(frozen=True)
class CacheIO:
    """What one batch's attention layers read from and write to the pool (device index tensors).

    Each layer's K/V source is [pool rows read | the batch's new rows], [P + T, Hkv, D]; the
    batch's kv_index and `write_src` index that source.
    """

    cache: PrefixCache
    lease: Lease
    read_rows: Tensor | None  # [P] int64 pool rows this batch reads (None: it reads none)
    write_rows: Tensor | None  # [sum write_lens] int64 pool rows this batch writes (None: none)
    write_src: Tensor | None  # [sum write_lens] int64 row of the source holding each written row

    def extend(self, layer: int, k: Tensor, v: Tensor,
               gather_pair: GatherPairFn) -> tuple[Tensor, Tensor]:
        """k, v [T, Hkv, D] -> [P + T, Hkv, D], storing this layer's new blocks on the way."""
        if self.read_rows is not None:
            kp, vp = gather_pair(self.cache.k[layer], self.cache.v[layer], self.read_rows)  # [P, Hkv, D]
            k, v = torch.cat((kp, k)), torch.cat((vp, v))
        if self.write_rows is not None and self.write_src is not None:
            # NOTE: detached: the pool is a constant to autograd, never part of a graph.
            self.cache.k[layer].index_copy_(0, self.write_rows, k.detach().index_select(0, self.write_src))
            self.cache.v[layer].index_copy_(0, self.write_rows, v.detach().index_select(0, self.write_src))
        return k, v

    def commit(self) -> None:
        """The forward succeeded: its blocks become readable from the next plan on."""
        self.cache.commit_later(self.lease)

    def abort(self) -> None:
        self.cache.abort(self.lease)
