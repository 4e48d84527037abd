"""The prefix cache changes no output: cache on vs cache off (fp32 CPU, 1e-4), and vs transformers.

Reference: the same checkpoint loaded with prefix_cache_size=0, run in mode "off" (no trie, no
cache), or transformers' own Qwen3 classes for the real-text cases. Batches mix shared prefixes,
prefixes of other sequences, duplicates and lengths across block boundaries; pools are tiny so
evictions happen; batch N+1 is prepared before batch N runs, as the scheduler does. After every
run the free pool rows are filled with NaN: a batch that read a row no committed block owns
(a freed, evicted or half-written one) would return NaN.
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.runner import load_runner
from tests.test_model_forward import INSTRUCTION, RERANK_PREFIX, RERANK_SUFFIX  # written out there, independently


TOL = 1e-4


def _pack(seqs):
    ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    cu[1:] = np.cumsum([len(s) for s in seqs])
    return ids, cu


def _poison_free_rows(runner) -> None:
    cache = runner.prefix_cache
    with cache._lock:
        free = list(cache._free)
    if free:
        rows = (torch.tensor(free)[:, None] * cache.block + torch.arange(cache.block)).ravel()
        cache.k[:, rows] = float("nan")
        cache.v[:, rows] = float("nan")


def _reference(off, seqs):
    ids, cu = _pack(seqs)
    return off.run(off.prepare(ids, cu))  # no index: mode "off"


def _prepare(runner, seqs, use_index):
    """The runner's PreparedBatch with the trie forced on (threshold 1) or never built (0)."""
    ids, cu = _pack(seqs)
    gated = dataclasses.replace(runner, radix_mlp_threshold=1.0 if use_index else 0.0)
    return gated.prepare(ids, cu)


def _run_interleaved(on, off, batches):
    """Prepare batch k+1 before running batch k; every output against the cache-off reference."""
    pending = None
    for seqs, use_index in batches + [(None, None)]:
        nxt = (_prepare(on, seqs, use_index), seqs) if seqs is not None else None
        if pending is not None:
            fb, done = pending
            got = on.run(fb)
            _poison_free_rows(on)
            want = _reference(off, done)
            assert got.shape == want.shape
            assert torch.isfinite(got).all()
            assert (got - want).abs().max().item() < TOL
        pending = nxt


def _random_batches(rng, n, vocab=(100, 3000)):
    prefixes = [rng.integers(*vocab, size).tolist() for size in (0, 7, 16, 23, 40, 70)]
    batches, seen = [], []
    for _ in range(n):
        seqs = []
        for _ in range(int(rng.integers(1, 6))):
            kind = rng.random()
            base = prefixes[int(rng.integers(len(prefixes)))]
            if kind < 0.15 and seqs:
                seqs.append(list(seqs[-1]))  # a duplicate
            elif kind < 0.3 and base:
                seqs.append(base[:int(rng.integers(1, len(base) + 1))])  # a prefix of a prefix
            elif kind < 0.5 and seen:
                # an earlier batch's sequence cut anywhere (mostly mid-block) with a new tail:
                # reads the leading rows of a block that sequence wrote
                old = seen[int(rng.integers(len(seen)))]
                cut = int(rng.integers(1, len(old) + 1))
                seqs.append(old[:cut] + rng.integers(*vocab, int(rng.integers(0, 20))).tolist())
            else:
                seqs.append(base + rng.integers(*vocab, int(rng.integers(1, 25))).tolist())
        seen.extend(seqs)
        batches.append((seqs, bool(rng.random() < 0.5)))
    return batches


@pytest.fixture(scope="module")
def embedding_off(tiny_embedding_dir):
    return load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", prefix_cache_size=0)


@pytest.fixture(scope="module")
def reranker_off(tiny_reranker_dir):
    return load_runner(str(tiny_reranker_dir), device="cpu", dtype="float32", prefix_cache_size=0)


@pytest.mark.parametrize("size", ["96tokens", "auto"])
@pytest.mark.parametrize("kind", ["embedding", "reranker"])
def test_many_random_batches_match_cache_off(kind, size, request, tiny_embedding_dir,
                                             tiny_reranker_dir):
    directory = tiny_embedding_dir if kind == "embedding" else tiny_reranker_dir
    off = request.getfixturevalue(f"{kind}_off")
    on = load_runner(str(directory), device="cpu", dtype="float32", prefix_cache_size=size)
    assert on.prefix_cache is not None and off.prefix_cache is None
    _run_interleaved(on, off, _random_batches(np.random.default_rng(len(size)), 20))
    st_ = on.prefix_cache.stats()
    assert st_["hit_tokens"] > 100  # the test bites: prefixes were served from the pool
    if size == "96tokens":
        assert st_["evictions"] > 0


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=40),
                                   min_size=1, max_size=4), st.booleans()),
                min_size=1, max_size=5),
       st.sampled_from(["48tokens", "128tokens"]))
def test_hypothesis_against_cache_free_runner(reranker_off, tiny_reranker_dir, batches, size):
    """A 3-token alphabet: long shared runs, sequences that are prefixes of others, duplicates."""
    on = _ON.setdefault(size, load_runner(str(tiny_reranker_dir), device="cpu", dtype="float32",
                                          prefix_cache_size=size))
    _run_interleaved(on, reranker_off, [([[t + 200 for t in s] for s in seqs], idx)
                                        for seqs, idx in batches])


_ON: dict[str, object] = {}


def test_real_templates_match_transformers_across_batches(tiny_reranker_dir, tiny_embedding_dir):
    """One query-document pair per batch in the Qwen3-Reranker template; embedding queries too."""
    from transformers import AutoModel, AutoModelForCausalLM

    rr = load_runner(str(tiny_reranker_dir), device="cpu", dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_reranker_dir), dtype=torch.float32).eval()
    docs = ["Paris is the capital and largest city of France.", "The Eiffel Tower is in Paris.",
            "Berlin is the capital of Germany."]
    for doc in docs:
        text = f"{RERANK_PREFIX}<Instruct>: {INSTRUCTION}\n<Query>: capital of france\n<Document>: {doc}{RERANK_SUFFIX}"
        seq = rr.tokenizer.encode(text, add_special_tokens=False).ids
        fb = _prepare(rr, [seq], False)
        got = rr.run(fb)
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([seq]), logits_to_keep=1).logits[0, -1]
        assert abs(got[0].item() - (logits[rr.yes_id] - logits[rr.no_id]).item()) < TOL
    assert fb.forward.cached_tokens[0] >= 64  # system prompt, instruction and query came from the pool

    em = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32")
    hf = AutoModel.from_pretrained(str(tiny_embedding_dir), dtype=torch.float32).eval()
    prompt = f"Instruct: {INSTRUCTION}\nQuery:"
    prev: list[int] = []
    for query in ("what is the capital of france", "who wrote hamlet", "boiling point of water"):
        seq = em.tokenizer.encode(prompt + query).ids
        fb = _prepare(em, [seq], False)
        got = em.run(fb)
        with torch.no_grad():
            want = hf(input_ids=torch.tensor([seq])).last_hidden_state[0, -1]
        assert (got[0] - want).abs().max().item() < TOL
        # everything it shares with the query before, the prompt's tail block included
        shared = next((i for i, (a, b) in enumerate(zip(prev, seq)) if a != b), min(len(prev), len(seq)))
        assert fb.forward.cached_tokens[0] == shared
        prev = seq
    assert shared > 16  # more than the prompt's first whole block


def test_counts_of_a_cached_batch(tiny_embedding_dir):
    on = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32")
    seq = list(range(300, 340))
    first = _prepare(on, [seq], False)
    assert first.forward.cached_tokens == (0,) and first.forward.computed_tokens == (40,) and first.forward.num_rows == 40
    on.run(first)
    again = _prepare(on, [seq, seq[:20]], True)  # in-batch trie and cache together
    assert again.forward.cached_tokens == (19, 19)  # capped below the second sequence's last token
    again = _prepare(on, [seq], False)  # two blocks and its 8-token tail are cached: all but the last
    assert again.forward.cached_tokens == (39,) and again.forward.computed_tokens == (1,) and again.forward.num_rows == 1
    assert again.forward.cache_hit_tokens == 39 and again.forward.cache_miss_tokens == 1
    on.run(again)
    stats = on.prefix_cache.stats()
    assert stats["hit_tokens"] == 39 and stats["miss_tokens"] == 41


def test_a_shared_instruction_is_read_to_its_last_token(tiny_embedding_dir, embedding_off):
    """20 shared tokens (one block and 4 rows of the next) + distinct queries: 20 rows read."""
    on = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32")
    head = list(range(600, 620))
    first = head + list(range(700, 714))  # 34 tokens: its second block (16..31) is written whole
    on.run(_prepare(on, [first], False))
    for q in range(3):
        seq = head + list(range(800 + 20 * q, 800 + 20 * q + 3 + 4 * q))
        fb = _prepare(on, [seq], False)
        assert fb.forward.cached_tokens == (20,) and fb.forward.computed_tokens == (len(seq) - 20,)
        got = on.run(fb)
        assert (got - _reference(embedding_off, [seq])).abs().max().item() < TOL
    # two readers in one batch, one of them a prefix of the other: capped below its last token
    a, b_ = head + [900, 901, 902], head + [900]
    fb = _prepare(on, [a, b_], True)
    assert fb.forward.cached_tokens == (20, 20)
    got = on.run(fb)
    assert (got - _reference(embedding_off, [a, b_])).abs().max().item() < TOL


def test_failed_and_dropped_batches_give_everything_back(tiny_embedding_dir, embedding_off):
    on = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", prefix_cache_size="64tokens")
    cache = on.prefix_cache
    seq = list(range(500, 540))
    on.run(_prepare(on, [seq], False))
    base = cache.stats()
    fb = _prepare(on, [seq + list(range(600, 650))], False)  # pins 2 blocks, writes 2 of 3 new
    assert cache.bytes_in_use > base["bytes"]
    mlp = on.model.layers[-1].mlp

    def boom(x):  # after every layer's attention wrote its pool rows
        raise RuntimeError("injected")

    mlp.forward = boom
    try:
        with pytest.raises(RuntimeError, match="injected"):
            on.run(fb)
    finally:
        del mlp.forward
    assert cache.stats() == base and all(b.refs == 0 for b in fb.forward.cache.lease.pinned)
    _poison_free_rows(on)
    probe = [seq + list(range(600, 650))]
    _run_interleaved(on, embedding_off, [(probe, False), (probe, True)])
    dropped = _prepare(on, [list(range(700, 760))], False)
    lease = dropped.forward.cache.lease
    del dropped
    gc.collect()
    assert lease.done and all(b.refs == 0 for b in lease.pinned)


def test_concurrent_requests_through_the_scheduler(tiny_reranker_dir, reranker_off):
    from scheduler import Scheduler

    on = load_runner(str(tiny_reranker_dir), device="cpu", dtype="float32", prefix_cache_size="160tokens",
                     radix_mlp_threshold=0.95)
    rng = np.random.default_rng(7)
    reqs = [[seqs[0]] for seqs, _ in _random_batches(rng, 24)]

    async def go():
        sched = Scheduler(on, max_batch_tokens=96, max_batch_requests=None)
        sched.start()
        try:
            return await asyncio.wait_for(asyncio.gather(*(sched.submit(r) for r in reqs)), 30)
        finally:
            await asyncio.to_thread(sched.stop, drain=False, timeout=5)

    results = asyncio.run(go())
    for items, res in zip(reqs, results):
        want = _reference(reranker_off, items)
        assert abs(float(res.outputs[0]) - want[0].item()) < TOL
    assert on.prefix_cache.stats()["hit_tokens"] > 0


def test_compute_tokens_count_only_what_was_computed(tiny_embedding_dir):
    """SubmitResult.compute_tokens (the x-compute-tokens header): tokens less cache hits."""
    from scheduler import Scheduler

    on = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", prefix_cache_size="256tokens")
    seq = list(range(400, 450))  # 50 tokens: 3 whole 16-token blocks fit below the last token

    async def go():
        sched = Scheduler(on, max_batch_tokens=128, max_batch_requests=None)
        sched.start()
        try:
            first = await sched.submit([seq])
            again = await sched.submit([seq, seq[:40] + [9] * 5])
            return first, again
        finally:
            await asyncio.to_thread(sched.stop, drain=False, timeout=5)

    first, again = asyncio.run(go())
    assert first.compute_tokens == 50
    # Second request: the first item reads all but its last token from the pool (3 blocks and its
    # 2-token tail); the second reads the 40 tokens it shares with it.
    assert again.compute_tokens == (50 - 49) + (45 - 40)
    np.testing.assert_allclose(again.outputs[0], first.outputs[0], atol=TOL, rtol=0)


def test_modes_the_cache_cannot_serve_turn_it_off(tiny_embedding_dir, caplog):
    with caplog.at_level("INFO", logger="models"):
        assert load_runner(str(tiny_embedding_dir), device="cpu", pooling="mean").prefix_cache is None
        assert load_runner(str(tiny_embedding_dir), device="cpu", radix_attention="paper").prefix_cache is None
        assert load_runner(str(tiny_embedding_dir), device="cpu", prefix_cache_size="0").prefix_cache is None
    text = caplog.text
    assert "prefix cache off: pooling=mean" in text and "radix_attention=paper" in text and "size 0" in text
    with pytest.raises(ValueError):
        load_runner(str(tiny_embedding_dir), device="cpu", prefix_cache_size="many")
    import dataclasses

    on = load_runner(str(tiny_embedding_dir), device="cpu")
    for other in (dataclasses.replace(on, radix_attention="paper"), dataclasses.replace(on, pooling="cls")):
        assert _prepare(other, [list(range(300, 340))], True).forward.cache is None  # the pool stays unused


def test_metrics_report_the_cache(tiny_embedding_dir):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from scheduler.metrics import Metrics

    on = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", prefix_cache_size="32tokens")
    metrics = Metrics()
    metrics.watch_prefix_cache(on.prefix_cache)
    # 20 tokens = a block and a 4-token tail, 2 slots: a miss; a hit on 19 tokens (all but the
    # last); a new chain that evicts both (the tail, a leaf, first; then its parent)
    for start in (300, 300, 400):
        on.run(_prepare(on, [list(range(start, start + 20))], False))
    samples = {(s.name, s.labels.get("result")): s.value
               for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode())
               for s in fam.samples}
    assert samples[("radixserve_prefix_cache_tokens_total", "hit")] == 19
    assert samples[("radixserve_prefix_cache_tokens_total", "miss")] == 60 - 19
    assert samples[("radixserve_prefix_cache_evictions_total", None)] == 2
    assert samples[("radixserve_prefix_cache_bytes", None)] == on.prefix_cache.bytes_in_use > 0


def test_cached_forward_has_no_host_sync(tiny_reranker_dir):
    """Pool reads and writes are device index ops prepared on the host, like the rest."""
    from tests.test_model_hotpath import HOST_OPS, OpLog

    on = load_runner(str(tiny_reranker_dir), device="cpu", dtype="float32")
    seq = list(range(300, 340))
    on.run(_prepare(on, [seq], False))
    fb = _prepare(on, [seq + [7] * 20, seq[:30] + [8] * 5], True)  # reads and writes the pool
    assert fb.forward.cache.read_rows is not None and fb.forward.cache.write_rows is not None
    with OpLog() as log, torch.inference_mode():
        on.forward(fb.forward)
    assert not [op for op in log.ops if op in HOST_OPS], log.ops
    assert log.ops["aten.index_copy_"] == 2 * on.config.num_hidden_layers
