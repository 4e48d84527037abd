"""The hop between a front end and the engine (``server/frontends/wire.py``), in one process.

A burst of frames sent in one loop iteration leaves in one write and arrives intact and in order
(on asyncio's loop and uvloop's); frames cut anywhere parse whole; outputs come back equal to
what was sent; and ``RemoteScheduler`` -> ``Engine`` -> a scheduler whose answers the test
computes again carries a burst of submits and a cancel, each answered on its own.
"""
from __future__ import annotations

import asyncio
import pickle
import socket

import numpy as np
import pytest


def _loops() -> list:
    """pytest params: the event loops a channel runs on (asyncio's; uvloop's, which serves the httptools stack)."""
    try:
        import uvloop
        have = True
    except ImportError:
        have = False
    return [pytest.param(asyncio.new_event_loop, id="asyncio"),
            pytest.param(lambda: uvloop.new_event_loop(), id="uvloop",
                         marks=pytest.mark.skipif(not have, reason="uvloop not installed"))]


def _messages() -> list:
    rng = np.random.default_rng(0)
    return [("submit", 0, [[5, 6, 7], [1]], "rid-0", False, b""),
            ("cancel", 0),
            ("submit", 1, [list(range(70_000, 70_000 + 3000))], None, True, b"ns"),  # ids above 2**16
            ("result", 2, ("a", "<f4", (4, 64), 1, rng.standard_normal((4, 64)).astype(np.float32).tobytes()), 0.1,
             0.2, 9),
            ("big", rng.standard_normal(300_000).astype(np.float32).tobytes()),  # 1.2 MB: many reads
            *[("collect", i) for i in range(50)]]


class _CountingTransport:
    """A transport that counts its writes (uvloop's transports take no patched methods)."""

    def __init__(self, inner) -> None:
        self.inner, self.writes = inner, 0

    def write(self, data) -> None:
        self.writes += 1
        self.inner.write(data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _same(a, b) -> bool:
    return pickle.dumps(a, protocol=5) == pickle.dumps(b, protocol=5)


@pytest.mark.parametrize("new_loop", _loops())
def test_channel_sends_a_burst_in_one_write_intact_and_in_order(new_loop):
    from server.frontends import wire

    sent = _messages()

    async def scenario() -> tuple[list, list, int]:
        a, b = socket.socketpair()
        got: list = []
        done = asyncio.get_running_loop().create_future()
        lost: list = []

        def received(msg) -> None:
            got.append(msg)
            if len(got) == len(sent) and not done.done():
                done.set_result(None)

        left = await wire.Channel.open(a, lambda msg: None, lost.append)
        right = await wire.Channel.open(b, received, lost.append)
        counter = left._transport = _CountingTransport(left._transport)
        for msg in sent:  # one loop iteration: one write
            left.send(msg)
        await asyncio.wait_for(done, 60)
        left.close()
        while len(lost) < 2:
            await asyncio.sleep(0.01)
        right.send(("after", "close"))  # nothing is sent after the end
        return got, lost, counter.writes

    loop = new_loop()
    try:
        got, lost, writes = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert writes == 1
    assert len(got) == len(sent) and all(_same(g, w) for g, w in zip(got, sent))
    assert len(lost) == 2  # each end saw the connection end once


def test_channel_parses_frames_split_anywhere():
    """Frames cut at every kind of boundary (inside the length, inside the payload, several per
    read) come out whole and in order, each once."""
    from server.frontends import wire

    sent = _messages()
    stream = b"".join(wire.frame(m) for m in sent)
    rng = np.random.default_rng(1)
    for trial in range(6):
        got: list = []
        loop = asyncio.new_event_loop()
        try:
            channel = loop.run_until_complete(_make_channel(got.append))
        finally:
            loop.close()
        cuts = sorted(set(rng.integers(0, len(stream), size=(1, 7, 50, 400, 3000, 20)[trial]).tolist()))
        for a, b in zip([0, *cuts], [*cuts, len(stream)]):
            channel.data_received(stream[a:b])
        assert len(got) == len(sent) and all(_same(g, w) for g, w in zip(got, sent)), trial


async def _make_channel(on_message):
    from server.frontends import wire

    return wire.Channel(on_message, lambda exc: None)


def test_outputs_travel_as_one_buffer_and_come_back_equal():
    from server.frontends import wire

    rng = np.random.default_rng(2)
    pooled = [rng.standard_normal(64).astype(np.float32) for _ in range(5)]
    states = [rng.standard_normal((7, 64)).astype(np.float32)]  # one item's [L, E]
    ragged = [rng.standard_normal((n, 8)).astype(np.float32) for n in (3, 1, 4)]
    scores = [0.25, -1.5, 3.0]
    for outputs in (pooled, states, ragged, scores, [np.float32(0.5)]):
        packed = pickle.loads(pickle.dumps(wire.pack_outputs(outputs), protocol=5))
        back = wire.unpack_outputs(packed)
        assert len(back) == len(outputs)
        for b, o in zip(back, outputs):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(o))
            assert np.asarray(b).dtype == np.asarray(o).dtype
            if isinstance(b, np.ndarray) and b.ndim:
                assert b.flags.writeable  # as a pickled array would be
    assert wire.pack_outputs(pooled)[0] == "a" and wire.pack_outputs(ragged)[0] == "l"


class _FakeScheduler:
    """The engine's scheduler (``enqueue``/``cancel``): each item's output is its ids' sum and
    length (an independent computation the test repeats), released when the test says;
    cancellations are recorded."""

    alive = True
    queue_size = 0

    def __init__(self) -> None:
        self.release: asyncio.Event | None = None
        self.seen: list = []
        self.cancelled: list = []
        self.answering: list = []

    def enqueue(self, items, *, request_id=None, all_tokens=False, namespace=b""):
        from types import SimpleNamespace

        from scheduler import SubmitResult

        assert self.release is not None
        self.seen.append((request_id, all_tokens, namespace))
        ticket = SimpleNamespace(future=asyncio.get_running_loop().create_future(), label=request_id)

        async def answer() -> None:
            await self.release.wait()
            if ticket.future.done():
                return
            if request_id == "unpicklable":
                ticket.future.set_result(SubmitResult([lambda: 0], 0.5, 0.25, 1))
            else:
                ticket.future.set_result(SubmitResult([np.array([sum(i), len(i)], dtype=np.float32) for i in items],
                                                      0.5, 0.25, len(items)))

        self.answering.append(asyncio.ensure_future(answer()))
        return ticket

    def cancel(self, ticket) -> None:
        if not ticket.future.done():
            self.cancelled.append(ticket.label)
            ticket.future.cancel()


def test_a_burst_of_submits_and_a_cancel_cross_the_wire():
    """RemoteScheduler -> Engine -> scheduler in one loop: 40 submits and a cancel sent in one
    iteration each get their own answer (the cancelled one reaches the scheduler as a
    cancellation of its ticket, one whose answer does not pickle fails alone), request ids and
    namespaces arrive, and the engine's replies share writes."""
    from scheduler import BatchFailed
    from scheduler.metrics import Metrics
    from server.frontends.engine import Engine
    from server.frontends.remote import RemoteScheduler

    class Reaped:
        pid = 0

        def wait(self) -> int:
            return 0

    async def scenario():
        fake = _FakeScheduler()
        fake.release = asyncio.Event()
        engine = Engine(None, None, Metrics())  # type: ignore[arg-type]
        engine.scheduler = fake  # type: ignore[assignment]
        engine.stopping = True  # the front end's exit at the end is expected
        mine, theirs = socket.socketpair()
        fe = await engine.connect(0, Reaped(), mine)  # type: ignore[arg-type]
        counter = fe.channel._transport = _CountingTransport(fe.channel._transport)
        remote = RemoteScheduler(theirs, metrics=Metrics(), engine_alive=True)
        remote.start()
        items = [[[i, i + 1, i + 2]] * (1 + i % 3) for i in range(40)]
        tasks = [asyncio.create_task(remote.submit(it, request_id=f"r{i}", namespace=b"t%d" % (i % 2)))
                 for i, it in enumerate(items)]
        tasks.append(asyncio.create_task(remote.submit([[1]], request_id="unpicklable")))
        while len(fake.seen) < len(tasks):
            await asyncio.sleep(0.01)
        tasks[7].cancel()
        while "r7" not in fake.cancelled:
            await asyncio.sleep(0.01)
        fake.release.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)  # a hang only
        remote.stop()
        while not fe.gone:
            await asyncio.sleep(0.01)
        return items, results, fake, counter.writes

    loop = asyncio.new_event_loop()
    try:
        items, results, fake, writes = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert isinstance(results[7], asyncio.CancelledError) and fake.cancelled == ["r7"]
    assert sorted(fake.seen) == sorted([*((f"r{i}", False, b"t%d" % (i % 2)) for i in range(40)),
                                        ("unpicklable", False, b"")])
    assert isinstance(results[40], BatchFailed)  # an answer that does not pickle fails its request only
    for i, (it, res) in enumerate(zip(items, results)):
        if i == 7:
            continue
        assert [o.tolist() for o in res.outputs] == [[float(sum(x)), float(len(x))] for x in it]
        assert (res.queue_time_s, res.inference_time_s, res.compute_tokens) == (0.5, 0.25, len(it))
    assert writes < len(items) - 1  # the 39 results left in fewer writes than one each
