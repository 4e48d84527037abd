"""A lone short input's prefix-cache choice (models/lone_choice.py): the cheaper measured path,
the other one tried now and then, the same answer on both, and only for lone short batches.

Reference for the answers: the same checkpoint with the prefix cache off (`prefix_cache_size=0`);
the cache's own exactness against transformers is tests/test_prefix_cache_exact.py's.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models.lone_choice import LONE_TOKENS, TRIAL_WEIGHT, TRY_EVERY, LoneCacheChoice
from models.runner import load_runner

TOL = 1e-4


def test_an_unmeasured_path_is_tried_first_the_cache_first():
    choice = LoneCacheChoice()
    assert choice.use_cache() is True
    choice.record(True, 0.004)
    assert choice.use_cache() is False
    choice.record(False, 0.001)
    assert choice.use_cache() is False  # measured cheaper without


def test_the_cheaper_path_is_taken_and_the_other_one_batch_in_try_every():
    choice = LoneCacheChoice()
    choice.record(True, 0.001)
    choice.record(False, 0.003)
    picks = [choice.use_cache() for _ in range(4 * TRY_EVERY)]
    assert picks.count(False) == 4 and picks.count(True) == 4 * TRY_EVERY - 4
    for _ in range(60):  # the cache's path grows dear (a cold cache, another load): the choice follows
        choice.record(True, 0.010)
    picks = [choice.use_cache() for _ in range(4 * TRY_EVERY)]
    assert picks.count(True) == 4
    assert choice.describe()["cache_ms"] > choice.describe()["no_cache_ms"] == 3.0


def test_the_moving_average_weighs_the_newest_measure_by_an_eighth():
    choice = LoneCacheChoice()
    choice.record(False, 0.008)
    choice.record(False, 0.016)
    assert choice.cost[False] == pytest.approx(0.008 + (0.016 - 0.008) / 8)


def test_a_trial_weighs_a_half_and_trials_stay_out_of_the_99th_percentile():
    choice = LoneCacheChoice()
    choice.record(True, 0.001)
    choice.record(False, 0.003)  # the cache is the chosen path
    choice.record(False, 0.001)  # a trial of the other one
    assert choice.cost[False] == pytest.approx(0.003 + (0.001 - 0.003) * TRIAL_WEIGHT)
    choice.record(True, 0.009)  # the chosen path: an eighth
    assert choice.cost[True] == pytest.approx(0.001 + (0.009 - 0.001) / 8)
    assert 1 / TRY_EVERY < 0.005


def test_applies_to_one_sequence_of_at_most_lone_tokens():
    assert LoneCacheChoice.applies(1, LONE_TOKENS)
    assert not LoneCacheChoice.applies(1, LONE_TOKENS + 1)
    assert not LoneCacheChoice.applies(2, 10)


@pytest.fixture(scope="module")
def runners(tiny_embedding_dir):
    on = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", prefix_cache_size="4096tokens")
    off = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", prefix_cache_size=0)
    assert on.prefix_cache is not None and on.cache_usable()
    return on, off


def _batch(*seqs):
    ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    cu[1:] = np.cumsum([len(s) for s in seqs])
    return ids, cu


def _answer(runner, ids, cu):
    prepared = runner.prepare(ids, cu)
    return prepared, runner.run(prepared)


def test_a_lone_short_input_takes_the_chosen_path_with_the_same_answer(runners):
    on, off = runners
    query = list(range(5, 5 + LONE_TOKENS - 2))  # 30 tokens: one full block and a partial one
    ids, cu = _batch(query)
    want = off.run(off.prepare(ids, cu))
    on.lone_choice = choice = LoneCacheChoice()
    try:
        on.prefix_cache.reset()
        first, got1 = _answer(on, ids, cu)  # unmeasured: the cache, which writes the query
        assert first.lone_cached is True and first.forward.cache is not None
        assert choice.cost[True] is not None  # run recorded its prepare + run
        second, got2 = _answer(on, ids, cu)  # the other path, unmeasured: no cache at all
        assert second.lone_cached is False and second.forward.cache is None
        assert second.computed_tokens == (len(query),)
        choice.record(True, 0.0)  # the cache measured cheaper: it is read, the query hits
        choice.record(True, 0.0)
        choice.cost[False] = 1.0
        choice.count = 0
        third, got3 = _answer(on, ids, cu)
        assert third.lone_cached is True and third.computed_tokens[0] < len(query)
        for got in (got1, got2, got3):
            torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), atol=TOL, rtol=TOL)
    finally:
        on.lone_choice = None


def test_two_inputs_or_a_longer_one_always_use_the_cache(runners):
    on, _ = runners
    on.lone_choice = choice = LoneCacheChoice()
    choice.record(True, 1.0)
    choice.record(False, 0.0)  # skipping measured far cheaper: still not for these
    try:
        for seqs in ([list(range(3, 13)), list(range(3, 15))], [list(range(7, 8 + LONE_TOKENS))]):
            prepared, _ = _answer(on, *_batch(*seqs))
            assert prepared.lone_cached is None and prepared.forward.cache is not None
        assert choice.count == 0
    finally:
        on.lone_choice = None
