"""The service awaits the scheduler in the request's own task; a client that leaves cancels it.

``Service._submit`` runs the scheduler's submit in the calling task and watches the connection
beside it: the client's disconnect cancels the submit (the scheduler drops what is still queued)
and reads as ``ClientGone``; a cancellation from outside (the server's drain) stays a
cancellation; the answer comes back as it is, and the watcher ends with the request.
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


def _request(disconnect: asyncio.Event) -> Request:
    async def receive():
        await disconnect.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/embed", "headers": [], "state": {"request_id": "r1"}}
    return Request(scope, receive)


def _service(scheduler: FakeScheduler) -> Service:
    return SimpleNamespace(scheduler=scheduler)  # type: ignore[return-value]  # _submit reads nothing else


def _run(coro):
    return asyncio.run(coro)


def test_the_answer_comes_back_and_the_watcher_ends():
    async def main():
        sched, leave = FakeScheduler(), asyncio.Event()
        sched.answer.set_result("outputs")
        before = set(asyncio.all_tasks())
        got = await Service._submit(_service(sched), _request(leave), [[1, 2]], all_tokens=False)
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
