"""server/http/deadline.py: a message already there is returned without a timer; one that is
not is awaited under the deadline, the receive coroutine cancelled past it; a cancellation from
outside stays a cancellation."""
import asyncio

import pytest

from server.http.deadline import receive_before

try:
    import uvloop
    RUNS = [asyncio.run, uvloop.run]  # the server's loop, and asyncio's
except ImportError:  # pragma: no cover - uvloop is a dependency
    RUNS = [asyncio.run]


@pytest.mark.parametrize("run", RUNS)
def test_a_ready_message_is_returned_without_suspending(run):
    async def receive():
        return {"type": "http.request", "body": b"x"}

    async def main():
        loop = asyncio.get_running_loop()
        before = len(loop._scheduled) if hasattr(loop, "_scheduled") else None
        coro = receive_before(receive(), loop.time() + 10)
        try:
            coro.send(None)  # finishes in its first step: it never waited on anything
        except StopIteration as done:
            assert done.value == {"type": "http.request", "body": b"x"}
        else:
            raise AssertionError("receive_before suspended on a message that was there")
        if before is not None:
            assert len(loop._scheduled) == before  # no timer left behind

    run(main())


@pytest.mark.parametrize("run", RUNS)
def test_a_message_that_comes_later_is_awaited(run):
    async def main():
        event = asyncio.Event()
        state = {}

        async def receive():
            await event.wait()
            state["woke"] = True
            return {"type": "http.request", "body": b"late"}

        loop = asyncio.get_running_loop()
        loop.call_soon(event.set)
        got = await receive_before(receive(), loop.time() + 60)
        assert got == {"type": "http.request", "body": b"late"} and state["woke"]

    run(main())


@pytest.mark.parametrize("run", RUNS)
def test_past_the_deadline_the_receive_is_cancelled_and_timeout_raised(run):
    async def main():
        seen = []

        async def receive():
            try:
                await asyncio.Event().wait()  # never set
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            await receive_before(receive(), loop.time() + 0.01)
        assert seen == ["cancelled"]

    run(main())


@pytest.mark.parametrize("run", RUNS)
def test_a_cancellation_from_outside_is_not_a_timeout(run):
    async def main():
        entered = asyncio.Event()

        async def receive():
            entered.set()
            await asyncio.Event().wait()

        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(receive_before(receive(), loop.time() + 60))
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())


@pytest.mark.parametrize("run", RUNS)
def test_an_awaitable_that_is_not_a_coroutine_is_awaited_under_the_deadline(run):
    async def main():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        loop.call_soon(fut.set_result, {"type": "http.disconnect"})
        assert await receive_before(fut, loop.time() + 60) == {"type": "http.disconnect"}
        never = loop.create_future()
        with pytest.raises(TimeoutError):
            await receive_before(never, loop.time() + 0.01)

    run(main())
