"""The runner contract (scheduler/contract.py) holds for the real runner and for every fake.

The scheduler reads a runner and its prepared batch only through ``ModelRunner`` and
``Prepared``. Here the real ``models.load_runner`` on the tiny fixture and the test fakes are held
to them at run time: every declared member present, every declared method callable the way the
protocol declares it (positional parameters by position, keyword-only ones by name with the same
default), and the figures the scheduler reads consistent with the batch that was prepared.
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest

from scheduler import ModelRunner, Prepared
from scheduler.packing import split_outputs
from tests.test_runner_all_tokens import MaskRunner
from tests.test_scheduler import FakeRunner
from tests.test_scheduler_e2e import GatedPrepRunner

# Two sequences sharing a 3-token prefix: [B] = 2, N = 9.
IDS = np.array([5, 6, 7, 8, 9, 5, 6, 7, 10], dtype=np.int32)
CU = np.array([0, 5, 9], dtype=np.int32)


def members(proto: type) -> list[str]:
    return sorted(name for name in vars(proto) if not name.startswith("_"))


def signature_problems(impl, proto: type, name: str) -> list[str]:
    """How ``impl.name`` (bound) cannot be called as ``proto.name`` declares; [] when it can."""
    declared = list(inspect.signature(getattr(proto, name)).parameters.values())[1:]  # less self
    params = list(inspect.signature(getattr(impl, name)).parameters.values())
    by_name = {p.name: p for p in params}
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    problems = []
    wanted_pos = [p for p in declared if p.kind is p.POSITIONAL_OR_KEYWORD]
    if len(positional) < len(wanted_pos) and not any(p.kind is p.VAR_POSITIONAL for p in params):
        problems.append(f"{name}: takes {len(positional)} positional arguments, the contract passes {len(wanted_pos)}")
    for p in declared:
        if p.kind is not p.KEYWORD_ONLY:
            continue
        got = by_name.get(p.name)
        if got is None or got.kind not in (got.KEYWORD_ONLY, got.POSITIONAL_OR_KEYWORD):
            if not has_var_kw:
                problems.append(f"{name}: no keyword argument {p.name!r}")
        elif got.default is not p.default and got.default != p.default:
            problems.append(f"{name}: {p.name!r} defaults to {got.default!r}, the contract says {p.default!r}")
    declared_names = {p.name for p in declared}
    for i, p in enumerate(params):
        required = p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        passed = p.name in declared_names or (p.kind is not p.KEYWORD_ONLY and i < len(wanted_pos))
        if required and not passed:
            problems.append(f"{name}: requires {p.name!r}, which the contract never passes")
    return problems


def assert_conforms(obj, proto: type) -> None:
    assert isinstance(obj, proto), f"{type(obj).__name__} lacks some of {members(proto)}"
    problems = [q for name in members(proto) if callable(getattr(proto, name))
                for q in signature_problems(obj, proto, name)]
    assert not problems, problems


def assert_figures(prepared, ids: np.ndarray, cu: np.ndarray) -> None:
    """What the scheduler reads of a prepared batch agrees with the batch it was made from."""
    assert_conforms(prepared, Prepared)
    lengths = np.diff(cu).tolist()
    assert prepared.n_tokens == len(ids) == int(cu[-1])
    assert 1 <= prepared.n_compact <= prepared.n_tokens
    assert 0.0 < prepared.ratio <= 1.0
    computed = list(prepared.computed_tokens)
    assert len(computed) == len(lengths) and all(0 <= c <= n for c, n in zip(computed, lengths))


def drive(runner) -> None:
    """The calls the pipeline makes, both ways it makes them (no item flagged, some flagged)."""
    assert_conforms(runner, ModelRunner)
    for mask in (None, np.array([False, True])):
        prepared = runner.prepare(IDS, CU, all_tokens=mask)
        assert_figures(prepared, IDS, CU)
        outputs = split_outputs(runner.run(prepared), len(CU) - 1)
        if mask is not None:  # the flagged item answers one row per token
            assert np.shape(outputs[1])[0] == CU[2] - CU[1]


def test_the_real_runner_and_its_prepared_batch_satisfy_the_contract(tiny_embedding_dir):
    import models

    runner = models.load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", radix_mlp_threshold=1.0)
    drive(runner)
    prepared = runner.prepare(IDS, CU)  # threshold 1 keeps the trie: the shared 3 tokens run once
    assert prepared.ratio == pytest.approx(6 / 9) and prepared.n_compact <= 6


def _released(runner):
    for gate in ("prep_gate", "release"):  # fakes that park their first prepare until told
        if hasattr(runner, gate):
            getattr(runner, gate).set()
    return runner


@pytest.mark.parametrize("make", [FakeRunner, GatedPrepRunner, MaskRunner])
def test_every_fake_runner_satisfies_the_contract(make):
    drive(_released(make()))


def test_the_check_catches_a_runner_off_the_contract():
    class NoMask(FakeRunner):
        def prepare(self, input_ids, cu_seqlens):
            return super().prepare(input_ids, cu_seqlens)

    class NoComputed:
        n_tokens, n_compact, ratio = 9, 9, 1.0

    with pytest.raises(AssertionError, match="all_tokens"):
        assert_conforms(NoMask(), ModelRunner)
    with pytest.raises(AssertionError, match="NoComputed"):
        assert_conforms(NoComputed(), Prepared)
