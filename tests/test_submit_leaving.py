"""The service awaits the scheduler in the request's own task; a client that leaves cancels it.

``Service._submit`` runs the scheduler's submit in the calling task and, once the request has
waited ``WATCH_AFTER_S``, watches the connection beside it: the client's disconnect cancels the
submit (the scheduler drops what is still queued) and reads as ``ClientGone``; a cancellation from
outside (the server's drain) stays a cancellation; the answer comes back as it is, a request
answered sooner never listens to its connection, and the watcher ends with the request.
"""
from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from scheduler import BatchFailed
from server.http.errors import ApiError, ClientGone
from server.service.core import Service


class FakeScheduler:
    """Records how each submit ended; answers when ``answer`` is set."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.answer: asyncio.Future = asyncio.get_running_loop().create_future()
        self.ended: list[str] = []

    async def submit(self, items, *, request_id=None, all_tokens=False, namespace=b""):
        self.entered.set()
        try:
            return await self.answer
        except asyncio.CancelledError:
            self.ended.append("cancelled")  # the real scheduler drops the queued entries here
            raise


def _request(disconnect: asyncio.Event, listening: asyncio.Event | None = None) -> Request:
    async def receive():
        if listening is not None:
            listening.set()
        await disconnect.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/embed", "headers": [], "state": {"request_id": "r1"}}
    return Request(scope, receive)


def _service(scheduler: FakeScheduler) -> Service:
    return SimpleNamespace(scheduler=scheduler)  # type: ignore[return-value]  # _submit reads nothing else


def _run(coro):
    return asyncio.run(coro)


def test_an_answer_at_once_comes_back_without_a_watcher():
    async def main():
        sched, leave, listening = FakeScheduler(), asyncio.Event(), asyncio.Event()
        sched.answer.set_result("outputs")
        before = set(asyncio.all_tasks())
        got = await Service._submit(_service(sched), _request(leave, listening), [[1, 2]], all_tokens=False)
        assert not (set(asyncio.all_tasks()) - before)
        assert not listening.is_set()  # the connection was never read
        return got, sched.ended

    assert _run(main()) == ("outputs", [])


def test_a_waiting_request_starts_the_watcher_and_it_ends_with_the_answer():
    async def main():
        sched, leave, listening = FakeScheduler(), asyncio.Event(), asyncio.Event()
        before = set(asyncio.all_tasks())
        task = asyncio.ensure_future(Service._submit(_service(sched), _request(leave, listening), [[1]],
                                                     all_tokens=False))
        await listening.wait()  # the request waited WATCH_AFTER_S: its connection is watched
        sched.answer.set_result("outputs")
        got = await task
        await asyncio.sleep(0)  # the watcher's cancellation is delivered
        assert not (set(asyncio.all_tasks()) - before - {asyncio.current_task()})
        return got, sched.ended

    assert _run(main()) == ("outputs", [])


def test_a_client_that_leaves_cancels_the_submit_and_reads_as_gone():
    async def main():
        sched, leave = FakeScheduler(), asyncio.Event()
        task = asyncio.ensure_future(Service._submit(_service(sched), _request(leave), [[1]], all_tokens=False))
        await sched.entered.wait()
        leave.set()
        with pytest.raises(ClientGone):
            await task
        if sys.version_info >= (3, 11):
            assert task.cancelling() == 0  # the cancellation it asked for was taken back
        return sched.ended

    assert _run(main()) == ["cancelled"]


def test_a_cancellation_from_outside_stays_a_cancellation():
    async def main():
        sched, leave = FakeScheduler(), asyncio.Event()
        task = asyncio.ensure_future(Service._submit(_service(sched), _request(leave), [[1]], all_tokens=False))
        await sched.entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        leave.set()  # the client leaving afterwards changes nothing
        await asyncio.sleep(0)
        return sched.ended

    assert _run(main()) == ["cancelled"]


def test_a_failed_batch_is_a_backend_error():
    async def main():
        sched, leave = FakeScheduler(), asyncio.Event()
        sched.answer.set_exception(BatchFailed("the model failed on this batch"))
        with pytest.raises(ApiError) as info:
            await Service._submit(_service(sched), _request(leave), [[1]], all_tokens=False)
        return info.value

    assert _run(main()).kind == "backend"
