"""A lone short input's path (models/lone_choice.py): the prefix cache or not, torch's threads or
one; the cheapest measured path, the others tried now and then in turn, the same answer on every
path, and only for lone short batches.

Reference for the answers: the same checkpoint with the prefix cache off (`prefix_cache_size=0`)
on torch's threads; the cache's own exactness against transformers is
tests/test_prefix_cache_exact.py's.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models.lone_choice import LONE_TOKENS, TRIAL_WEIGHT, TRY_EVERY, LoneChoice, Path, paths
from models.runner import load_runner

TOL = 1e-4
FOUR = paths(True, 2)  # cache and 2 threads, cache and 1, no cache and 2, no cache and 1


def _measured(choice: LoneChoice, costs: dict[Path, float]) -> None:
    """Each path's first (unrecorded) batch, then its cost."""
    for path, seconds in costs.items():
        choice.record(path, 99.0)
        choice.record(path, seconds)


def test_the_candidates_the_cache_first_then_all_threads_first():
    assert FOUR == (Path(True, 2), Path(True, 1), Path(False, 2), Path(False, 1))
    assert paths(False, 4) == (Path(False, 4), Path(False, 1))
    assert paths(True, 1) == (Path(True, 1), Path(False, 1))
    assert paths(False, 1) == (Path(False, 1),)


def test_each_path_is_tried_first_in_order_and_its_first_batch_is_not_a_measure():
    choice = LoneChoice()
    order = []
    for _ in range(2 * len(FOUR)):
        path = choice.choose(FOUR)
        order.append(path)
        choice.record(path, 0.001 * (FOUR.index(path) + 1))
    assert order == [p for p in FOUR for _ in range(2)]  # the first batch of each builds its kernels
    assert choice.cost == {p: 0.001 * (i + 1) for i, p in enumerate(FOUR)}  # the 99 ms never counted
    assert choice.choose(FOUR) == Path(True, 2)


def test_the_cheapest_path_is_taken_and_the_others_one_batch_in_try_every_in_turn():
    choice = LoneChoice()
    _measured(choice, {Path(True, 2): 0.004, Path(True, 1): 0.003, Path(False, 2): 0.002, Path(False, 1): 0.001})
    picks = [choice.choose(FOUR) for _ in range(6 * TRY_EVERY)]
    assert picks.count(Path(False, 1)) == 6 * TRY_EVERY - 6
    assert [p for p in picks if p != Path(False, 1)] == [Path(True, 2), Path(True, 1), Path(False, 2)] * 2
    for _ in range(60):  # one thread grows dear (a neighbour's load on the other core): the choice follows
        choice.record(Path(False, 1), 0.010)
    assert choice.choose(FOUR) == Path(False, 2)
    assert choice.describe()["paths"]["no cache, 2 threads"] == 2.0


def test_the_moving_average_weighs_the_newest_measure_by_an_eighth():
    choice = LoneChoice()
    _measured(choice, {Path(False, 1): 0.008})
    choice.record(Path(False, 1), 0.016)
    assert choice.cost[Path(False, 1)] == pytest.approx(0.008 + (0.016 - 0.008) / 8)


def test_a_trial_weighs_a_half_and_trials_stay_out_of_the_99th_percentile():
    choice = LoneChoice()
    cached, plain = Path(True, 1), Path(False, 1)
    _measured(choice, {cached: 0.001, plain: 0.003})  # the cache is the chosen path
    choice.record(plain, 0.001)  # a trial of the other one
    assert choice.cost[plain] == pytest.approx(0.003 + (0.001 - 0.003) * TRIAL_WEIGHT)
    choice.record(cached, 0.009)  # the chosen path: an eighth
    assert choice.cost[cached] == pytest.approx(0.001 + (0.009 - 0.001) / 8)
    assert 1 / TRY_EVERY < 0.005


def test_applies_to_one_sequence_of_at_most_lone_tokens():
    assert LoneChoice.applies(1, LONE_TOKENS)
    assert not LoneChoice.applies(1, LONE_TOKENS + 1)
    assert not LoneChoice.applies(2, 10)


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


@pytest.fixture
def two_threads():
    """Torch on 2 threads whatever the machine, so that one thread is a different path."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _choosing(path: Path, candidates: tuple[Path, ...]) -> LoneChoice:
    """A choice whose cheapest measured path is ``path``."""
    choice = LoneChoice()
    _measured(choice, {p: (0.001 if p == path else 1.0) for p in candidates})
    return choice


def _threads_seen(runner) -> list[int]:
    """torch's thread count inside each forward of ``runner`` from now on."""
    seen: list[int] = []
    served = runner._served

    def spy(batch):
        seen.append(torch.get_num_threads())
        return served(batch)

    runner._served = spy
    return seen


def test_every_path_gives_the_same_answer_on_its_threads(runners, two_threads):
    on, off = runners
    query = list(range(5, 5 + LONE_TOKENS - 2))  # 30 tokens: one full block and a partial one
    ids, cu = _batch(query)
    want = off.run(off.prepare(ids, cu))
    on.prefix_cache.reset()
    on.run(on.prepare(ids, cu))  # the query in the cache: the cached paths read it
    seen = _threads_seen(on)
    got = {}
    try:
        for path in FOUR:
            on.lone_choice = _choosing(path, FOUR)
            prepared, got[path] = _answer(on, ids, cu)
            assert prepared.lone == path
            assert (prepared.forward.cache is not None) == path.cached
            if path.cached:
                assert prepared.computed_tokens[0] < len(query)  # a hit
            else:
                assert prepared.computed_tokens == (len(query),)
            assert seen[-1] == path.threads and torch.get_num_threads() == 2
            assert on.lone_choice.cost[path] != 0.001  # run recorded its prepare + run
            torch.testing.assert_close(torch.as_tensor(got[path]), torch.as_tensor(want), atol=TOL, rtol=TOL)
        torch.testing.assert_close(torch.as_tensor(got[Path(False, 1)]), torch.as_tensor(got[Path(False, 2)]))
    finally:
        on.lone_choice = None
        del on._served


def test_without_a_usable_cache_only_the_threads_are_chosen(runners, two_threads):
    _, off = runners
    ids, cu = _batch(list(range(9, 20)))
    off.lone_choice = choice = _choosing(Path(False, 1), paths(False, 2))
    try:
        prepared, _ = _answer(off, ids, cu)
        assert prepared.lone == Path(False, 1) and prepared.forward.cache is None
        assert set(choice.cost) == {Path(False, 2), Path(False, 1)}
    finally:
        off.lone_choice = None


def test_a_failing_forward_gives_the_threads_back(runners, two_threads):
    _, off = runners
    off.lone_choice = _choosing(Path(False, 1), paths(False, 2))

    def broken(batch):
        raise RuntimeError("forward failed")

    off._served = broken
    try:
        with pytest.raises(RuntimeError, match="forward failed"):
            _answer(off, *_batch(list(range(9, 20))))
        assert torch.get_num_threads() == 2
    finally:
        off.lone_choice = None
        del off._served


def test_two_inputs_or_a_longer_one_always_use_the_cache_on_every_thread(runners, two_threads):
    on, _ = runners
    on.lone_choice = choice = _choosing(Path(False, 1), FOUR)  # the lone path measured far cheaper
    seen = _threads_seen(on)
    try:
        for seqs in ([list(range(3, 13)), list(range(3, 15))], [list(range(7, 8 + LONE_TOKENS))]):
            prepared, _ = _answer(on, *_batch(*seqs))
            assert prepared.lone is None and prepared.forward.cache is not None
            assert seen[-1] == 2
        assert choice.count == 0
    finally:
        on.lone_choice = None
        del on._served
