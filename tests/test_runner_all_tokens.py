"""Per-token outputs (/embed_all's path): the runner's all_tokens mask and the scheduler's flag.

Oracle: transformers' Qwen3Model (last hidden state, after the final norm), fp32 CPU, 1e-4, for
the flagged items; the cache-off runner for the pooled items batched beside them. A batch with a
flagged item must not read the prefix cache (cached tokens have no hidden-state row): the test
warms the cache first and checks that the same batch without the flag would have hit it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest
import torch

from models.runner import load_runner
from tests.test_scheduler import FakeRunner, run_async

PREFIX = ("the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat by the door, "
          "and the old farmer walks slowly across the wide green field towards the red barn at dawn")


def _pack(seqs):
    ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    cu[1:] = np.cumsum([len(s) for s in seqs])
    return ids, cu


@pytest.fixture(scope="module")
def runner(tiny_embedding_dir):
    return load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", radix_mlp_threshold=1.0,
                       prefix_cache_size="4096tokens")


@pytest.fixture(scope="module")
def hf_model(tiny_embedding_dir):
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(tiny_embedding_dir), dtype=torch.float32).eval()


def _hf_states(hf_model, ids):
    with torch.inference_mode():
        return hf_model(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()  # [L, E]


@pytest.mark.parametrize("mode", ["compact", "paper", "off"])
def test_flagged_items_answer_every_token_and_skip_the_cache(runner, hf_model, mode):
    tok = runner.tokenizer
    seqs = [tok.encode(PREFIX + t).ids for t in (" and barks", " and purrs", " and sings loudly")]
    assert min(map(len, seqs)) > 2 * 16  # spans whole cache blocks
    r = dataclasses.replace(runner, radix_mlp_threshold=0.0) if mode == "off" else (
        dataclasses.replace(runner, radix_attention=mode) if mode == "paper" else runner)
    warm = runner.prepare(*_pack(seqs[:1]))
    runner.run(warm)  # commits the shared prefix's blocks to the pool
    plain = r.prepare(*_pack(seqs))
    if mode == "compact":
        assert plain.forward.cache is not None and plain.forward.cache_hit_tokens > 0
    pooled_ref = r.run(plain)  # [B, E]
    mask = np.array([False, True, True])
    prepared = r.prepare(*_pack(seqs), all_tokens=mask)
    assert prepared.forward.cache is None and prepared.token_items == (1, 2)
    assert prepared.used_index == (mode != "off")
    out = r.run(prepared)
    assert len(out) == 3
    np.testing.assert_allclose(out[0], pooled_ref[0].numpy(), atol=1e-4, rtol=0)
    for i in (1, 2):
        want = _hf_states(hf_model, seqs[i])
        assert out[i].shape == want.shape
        np.testing.assert_allclose(out[i], want, atol=1e-4, rtol=0)
        np.testing.assert_allclose(out[i][-1], pooled_ref[i].numpy(), atol=1e-4, rtol=0)  # last-token pooling


def test_all_tokens_mask_is_checked(runner):
    ids, cu = _pack([[1, 2, 3], [1, 2]])
    with pytest.raises(ValueError, match="all_tokens"):
        runner.prepare(ids, cu, all_tokens=np.array([True]))
    p = runner.prepare(ids, cu, all_tokens=np.array([False, False]))  # none flagged: a plain batch
    assert p.token_items == () and p.token_rows is None
    runner.run(p)


class MaskRunner(FakeRunner):
    """FakeRunner (flagged items answer [L, 2]) that records the all_tokens mask per batch."""

    def __init__(self):
        super().__init__()
        self.masks: list = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def prepare(self, input_ids, cu_seqlens, *, all_tokens=None, namespaces=None):
        self.entered.set()
        self.release.wait(10)  # the first batch waits until everything else is queued
        self.masks.append(all_tokens)
        return super().prepare(input_ids, cu_seqlens, all_tokens=all_tokens)


def test_scheduler_passes_the_mask_only_when_an_item_wants_it():
    runner = MaskRunner()

    async def go(sched):
        first = asyncio.ensure_future(sched.submit([[9, 9]]))
        await asyncio.to_thread(runner.entered.wait, 10)
        both = asyncio.gather(sched.submit([[1, 2, 3]]), sched.submit([[4, 5], [6]], all_tokens=True))
        await asyncio.sleep(0.05)
        runner.release.set()
        return await first, await both

    _, (first, (pooled, states)) = run_async(runner, go, max_batch_tokens=64)
    assert runner.masks[0] is None  # a batch of pooled items: the plain call
    assert runner.masks[1].tolist() == [False, True, True]  # one batch, one flag per item
    np.testing.assert_array_equal(pooled.outputs[0], [6.0, 3.0])
    np.testing.assert_array_equal(states.outputs[0], [[4, 1], [5, 1]])
    np.testing.assert_array_equal(states.outputs[1], [[6, 1]])
