"""Stage stamps (scheduler/stages.py) of requests through a real server: every stage is stamped,
in path order, and the steps between the client's send and its last byte add up to the whole."""
from __future__ import annotations

import json
import socket

import pytest

from benchmarks.bench_front import ONE_INPUT
from benchmarks.bench_latency import STEPS, exchange
from scheduler import stages
from tests.serving import serve


@pytest.fixture
def stamp_log():
    log = stages.StampLog()
    stages.recorder = log
    try:
        yield log
    finally:
        stages.recorder = None


@pytest.mark.parametrize("inputs", [ONE_INPUT, ["first input", "a second one", ONE_INPUT]])
def test_stages_are_ordered_and_sum_to_the_whole(tiny_embedding_dir, stamp_log, inputs):
    srv = serve(tiny_embedding_dir)
    try:
        sock = socket.create_connection(("127.0.0.1", srv.port))
        body = json.dumps({"inputs": inputs}).encode()
        sent = {}
        for i in range(5):
            exchange(sock, "GET", "/health")  # stamps received/written only: no path stages
            sent[f"r{i}"] = exchange(sock, "POST", "/embed", body, f"r{i}")
        sock.close()
    finally:
        srv.stop()
    got = stamp_log.take()
    for rid, (t0, t1) in sent.items():
        marks = got[rid]
        assert list(marks) == list(stages.STAGES)  # each stamped once, first in path order
        times = [t0, *(marks[s] for s in stages.STAGES), t1]
        assert times == sorted(times), marks
        steps = stages.durations(marks, t0, t1)
        assert steps is not None and list(steps) == list(STEPS)
        assert all(v >= 0 for v in steps.values())
        assert sum(steps.values()) == pytest.approx(t1 - t0, rel=1e-9, abs=1e-9)
    assert stamp_log.take() == {}  # take() empties the log
    health = [marks for rid, marks in got.items() if rid not in sent]
    assert health and all(set(m) == {"received", "written"} for m in health)


def test_durations_need_every_stage():
    assert stages.durations({"received": 1.0}, 0.0, 2.0) is None
