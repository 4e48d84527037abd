"""models/streams.py: what the CUDA overlap reads, checked on a CPU.

- every tensor a prepared batch holds is named by ``device_tensors`` (the CUDA path marks each one
  with ``record_stream``; a tensor it missed could be reused by a later copy while the forward
  reads it), checked against an independent walk of the batch's objects;
- a ``HostCopy`` waits on its event once and returns its finisher's value;
- on a CPU ``run`` returns its outputs as they are (no pending copy, no extra hop), also with
  ``defer_copies``.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from models import streams
def _walk(obj, seen, depth=0):
    """Every tensor reachable through dataclass fields, tuples and lists (independent of streams.py)."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth > 5 or id(obj) in seen:
        return
    seen.add(id(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _walk(getattr(obj, f.name), seen, depth + 1)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _walk(v, seen, depth + 1)


@pytest.fixture(scope="module")
def runner(tiny_embedding_dir):
    import models

    return models.load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", radix_mlp_threshold=1.0,
                              prefix_cache_size="4096tokens")


@pytest.mark.parametrize("all_tokens", [False, True])
def test_device_tensors_names_every_tensor_of_a_prepared_batch(runner, all_tokens):
    ids = np.arange(1, 41, dtype=np.int32) % 50 + 3
    ids[16:32] = ids[:16]  # a shared prefix: the trie and its gather indices are in use
    cu = np.array([0, 16, 40], np.int32)
    mask = np.array([False, True]) if all_tokens else None
    prepared = runner.prepare(ids, cu, all_tokens=mask)
    try:
        named = {id(t) for t in streams.device_tensors(prepared)}
        pool = set()
        if prepared.forward.cache is not None:  # the pool is allocated at load, never by a copy
            pool = {id(prepared.forward.cache.cache.k), id(prepared.forward.cache.cache.v)}
        reachable = {id(t) for t in _walk(prepared, set())} - pool
        assert reachable and reachable <= named
        assert prepared.ready is None  # no copy stream off CUDA
    finally:
        runner.run(prepared)  # settles the cache lease


class FakeEvent:
    def __init__(self):
        self.waits = 0

    def synchronize(self):
        self.waits += 1


def test_a_host_copy_waits_once_and_returns_the_finisher_value():
    event = FakeEvent()
    hosts = (torch.ones(2, 3), torch.zeros(4))
    copy = streams.HostCopy(hosts, event, lambda a, b: (a.sum().item(), b.shape))  # type: ignore[arg-type]
    assert streams.settled(copy) == (6.0, torch.Size([4])) and event.waits == 1
    assert streams.settled("done") == "done"


def test_on_a_cpu_run_returns_the_outputs_themselves(runner):
    ids = np.arange(3, 19, dtype=np.int32)
    cu = np.array([0, 7, 16], np.int32)
    waited = runner.run(runner.prepare(ids, cu))
    deferred = dataclasses.replace(runner, defer_copies=True, prefix_cache=None)
    out = deferred.run(deferred.prepare(ids, cu))
    assert isinstance(out, torch.Tensor) and torch.equal(out, waited)
    assert streams.copied(torch.device("cpu")) is None
    streams.await_copies(None, iter(()), torch.device("cpu"))  # a no-op without an event
