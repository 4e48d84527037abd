"""Awaiting one ASGI message before a deadline, without a timer when the message is already there.

The front door reads a request body under one deadline (server/http/front_door.py). A small
body usually arrives with its headers, so the server holds it before the app asks: ``receive()``
then completes without suspending, and a timeout context around it (a timer scheduled and
cancelled, the task's cancellation bookkeeping) would be pure cost on every request.
``receive_before`` steps the awaitable once: when it finishes there, its message is returned at
once; when it suspends, the rest of it runs under ``asyncio.timeout_at`` as before
(``_Resumed`` lets the task drive the coroutine already started, as if it had awaited it).
"""
from __future__ import annotations

import asyncio
import sys
from typing import Any, Awaitable, Generator


if sys.version_info >= (3, 11):
    async def before(awaitable: Awaitable[Any], deadline: float) -> Any:
        """``await awaitable``, or TimeoutError at loop time ``deadline`` (a timer on this task:
        no task of its own, as ``wait_for`` makes on Python 3.11)."""
        async with asyncio.timeout_at(deadline):
            return await awaitable
else:  # pragma: no cover - Python 3.10
    async def before(awaitable: Awaitable[Any], deadline: float) -> Any:
        return await asyncio.wait_for(awaitable, max(0.0, deadline - asyncio.get_running_loop().time()))


async def receive_before(pending: Awaitable[Any], deadline: float) -> Any:
    """What ``pending`` (a ``receive()`` call) returns: at once if it does not suspend, else
    awaited under the deadline (TimeoutError past it)."""
    if not asyncio.iscoroutine(pending):
        return await before(pending, deadline)
    try:
        first = pending.send(None)
    except StopIteration as done:
        return done.value
    return await before(_Resumed(pending, first), deadline)


class _Resumed:
    """A coroutine already stepped once (it yielded ``first``) as an awaitable: the awaiting task
    gets ``first`` and then drives the rest, what it sends or throws (a cancellation) passed on."""

    __slots__ = ("coro", "first")

    def __init__(self, coro: Any, first: Any) -> None:
        self.coro, self.first = coro, first

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, value = self.coro, self.first
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - thrown in by the task: the coroutine's to handle
                try:
                    value = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as done:
                    return done.value
