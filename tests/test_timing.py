"""Just-in-time batch formation: the clock's arithmetic, and the pipeline forming late under "prefix"."""
from __future__ import annotations

import asyncio

import pytest

from scheduler.timing import JustInTime
from tests.test_scheduler import FakeRunner, run_async


def test_no_delay_without_a_running_forward_or_an_estimate():
    clock = JustInTime(margin_s=0.01, slack=0.25)
    assert clock.delay_s(now=5.0) == 0.0  # nothing known yet
    clock.forward_started(1.0, rows=100)
    assert clock.delay_s(now=1.0) == 0.0  # running, but no estimate of how long it takes
    clock.forward_ended(2.0)
    assert clock.delay_s(now=10.0) == 0.0  # estimate, but nothing running


def test_delay_is_expected_end_minus_prep_and_margin():
    clock = JustInTime(margin_s=0.01, slack=0.25, alpha=0.5)
    clock.forward_started(0.0, rows=100)
    clock.forward_ended(1.0)  # 0.01 s per row
    clock.forward_started(2.0, rows=300)
    clock.forward_ended(1.5)  # 0.005 s per row; EMA 0.0075
    clock.prepared(0.2)
    clock.prepared(0.4)  # EMA starting from 0 (preparation assumed free until measured)
    clock.forward_started(100.0, rows=200)  # expected to take 200 rows * 0.0075 s
    prep = 0.5 * (0.5 * 0.0 + 0.5 * 0.2) + 0.5 * 0.4
    want_due = 100.0 + 0.75 * 200 * (0.5 * 0.01 + 0.5 * 0.005) - prep - 0.01
    assert clock.delay_s(now=100.5) == pytest.approx(want_due - 100.5)
    assert clock.delay_s(now=want_due + 1.0) == 0.0  # overdue: form at once


def test_holds_off_every_time_while_grouping_else_only_to_probe():
    clock = JustInTime(probe_every=3)
    assert [clock.hold_this_time() for _ in range(4)] == [True] * 4
    clock.set_grouping(False)  # the former chose FIFO's batch: hold off only every 3rd formation
    assert [clock.hold_this_time() for _ in range(6)] == [False, True, False, False, True, False]


@pytest.mark.parametrize("policy", ["fifo", "prefix"])
def test_prefix_policy_forms_the_next_batch_late_while_grouping_pays(policy):
    run_s = 0.4
    runner = FakeRunner(run_s=run_s)
    # Single-item requests alternating between two 30-token prefixes: two per batch, so the
    # prefix former regroups (A, A instead of A, B) and then holds off forming while one runs.
    reqs = [[[1 + r % 2] * 30 + [100 + r]] for r in range(10)]

    async def go(sched):
        return await asyncio.gather(*(sched.submit(items) for items in reqs))

    sched, results = run_async(runner, go, max_batch_tokens=62, policy=policy)
    assert [r.outputs[0][0] for r in results] == [float(sum(items[0])) for items in reqs]
    trace = list(sched.trace)
    gaps = [nxt.prep_start - cur.forward_start for cur, nxt in zip(trace[1:], trace[2:])]
    assert gaps
    if policy == "prefix":
        assert any(g > run_s / 2 for g in gaps), gaps
        late = [(c, n) for c, n in zip(trace[1:], trace[2:]) if n.prep_start - c.forward_start > run_s / 2]
        assert all(n.prep_start < c.forward_end for c, n in late)
    else:
        assert all(g < run_s / 2 for g in gaps), gaps
