"""The front end's scheduler: ``ServedScheduler`` over the socket to the engine process.

``submit`` sends the token ids with the request id, ``all_tokens`` and the cache namespace (one
frame, written with the others of its loop iteration: wire.py), and awaits the engine's answer:
the outputs as the real scheduler returns them, or its error re-raised here as ``BatchFailed``
(500) or ``WorkerDead`` (503). A cancelled submit (the client went away, or the drain cut it
off) sends a cancel, and the engine cancels its own submit, which drops the entries still
queued. ``alive`` is the engine's word: false once it says its model worker died, or once the
connection ends (the engine is gone); either fails every pending submit with ``WorkerDead`` and
calls ``on_death`` once, which drains this front end and makes it exit non-zero. ``ping`` asks the
engine for its health with a bound (/health: an engine stopped or stuck is unhealthy, not only a
dead one). The engine may ask for this process's metric families at any time (a
scrape on any front end gathers all of them); the answer is built on the event loop.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from typing import Any, Callable

from scheduler import BatchFailed, SubmitResult, WorkerDead
from scheduler.metrics import Metrics
from server.frontends import wire

log = logging.getLogger("radixserve.server")

SCRAPE_TIMEOUT_S = 10.0
PING_TIMEOUT_S = 2.0  # /health's wait for the engine's answer: past it the engine counts as stuck


class RemoteScheduler:
    def __init__(self, sock: socket.socket, *, metrics: Metrics, engine_alive: bool) -> None:
        self.metrics: Metrics | None = metrics  # this front end's own series
        self.on_death: Callable[[BaseException], None] | None = None
        self.startup: dict = {}  # /info's live ``startup`` (the view's): the engine's stages, sent once warm
        self._own = metrics
        self._sock = sock
        self._engine_alive = engine_alive
        self._closed = False
        self._stopping = False
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self._channel: wire.Channel | None = None
        self._ready: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    @property
    def alive(self) -> bool:
        return self._engine_alive and not self._closed and self._task is not None  # started: see start()

    @property
    def queue_size(self) -> int:
        return 0  # the queue is the engine's: its size is in the merged te_queue_size

    def start(self) -> None:
        """Open the connection on the running loop (the app's lifespan calls this)."""
        if self._task is None:
            self._ready = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._open())

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Close the connection (the front end is exiting); the engine sees its end of file."""
        self._stopping = True
        if self._channel is not None:
            self._channel.close()

    async def submit(self, items: list[list[int]], *, request_id: str | None = None,
                     all_tokens: bool = False, namespace: bytes = b"") -> SubmitResult:
        if not items:
            raise ValueError("submit needs at least one item")
        channel = self._channel if self._channel is not None and self.alive else await self._connected()
        sid = next(self._ids)
        future = channel.loop.create_future()
        self._waiting[sid] = future
        channel.send(("submit", sid, items, request_id, all_tokens, namespace))
        try:
            return await future
        except asyncio.CancelledError:
            if self._waiting.pop(sid, None) is not None and not self._closed:
                channel.send(("cancel", sid))
            raise
        finally:
            self._waiting.pop(sid, None)

    async def scrape(self) -> list:
        """Every process's metric families, merged by the engine (metrics_merge.py)."""
        channel = await self._connected()
        sid = next(self._ids)
        future = channel.loop.create_future()
        self._waiting[sid] = future
        channel.send(("scrape", sid))
        try:
            return await asyncio.wait_for(future, SCRAPE_TIMEOUT_S)
        finally:
            self._waiting.pop(sid, None)

    async def ping(self, timeout: float = PING_TIMEOUT_S) -> bool:
        """The engine's word on its health, within ``timeout`` seconds: True when its event loop
        answered and its model worker runs; False when it said otherwise, did not answer in time
        (stopped, stuck, swapped out) or is gone. /health asks on every call."""
        if not self.alive:
            return False
        channel = await self._connected()
        sid = next(self._ids)
        future = channel.loop.create_future()
        self._waiting[sid] = future
        channel.send(("ping", sid))
        try:
            return bool(await asyncio.wait_for(future, timeout))
        except (asyncio.TimeoutError, WorkerDead):
            return False
        finally:
            self._waiting.pop(sid, None)

    async def _connected(self) -> wire.Channel:
        if not self.alive:
            raise WorkerDead("the engine process is not running")
        if self._channel is None:
            assert self._ready is not None, "start() first"
            await self._ready.wait()
        if self._channel is None or not self.alive:
            raise WorkerDead("the engine process is not running")
        return self._channel

    async def _open(self) -> None:
        assert self._ready is not None
        def made() -> wire.Channel:  # set before any message arrives (an early "collect" answers on it)
            self._channel = wire.Channel(self._dispatch, self._lost)
            return self._channel

        try:
            await asyncio.get_running_loop().create_connection(made, sock=self._sock)
        except OSError as exc:
            self._lost(exc)
        finally:
            self._ready.set()

    def _lost(self, exc: BaseException | None) -> None:
        if not self._stopping:
            name = type(exc).__name__ if exc is not None else "end of file"
            self._died(f"the engine process is gone ({name})", closed=True)

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "result":
            _, sid, packed, queue_s, inference_s, compute = msg
            future = self._waiting.pop(sid, None)
            if future is not None and not future.done():  # else cancelled here meanwhile
                future.set_result(SubmitResult(wire.unpack_outputs(packed), queue_s, inference_s, compute))
        elif kind == "error":
            _, sid, what, text = msg
            self._settle(sid, error=BatchFailed(text) if what == "batch" else WorkerDead(text))
        elif kind in ("scraped", "pong"):
            self._settle(sid=msg[1], result=msg[2])
        elif kind == "collect":
            assert self._channel is not None
            self._channel.send(("collected", msg[1], list(self._own.registry.collect())))
        elif kind == "startup":
            self.startup.update(msg[1])
        elif kind == "dead":
            self._died(msg[1], closed=False)
        else:
            log.error("unknown message from the engine: %r", kind)

    def _settle(self, sid: int, *, result: Any = None, error: BaseException | None = None) -> None:
        future = self._waiting.pop(sid, None)
        if future is None or future.done():
            return  # cancelled here meanwhile
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def _died(self, reason: str, *, closed: bool) -> None:
        """The engine is gone or its model worker died: fail what waits, tell the app once."""
        first = self.alive
        self._engine_alive = False
        self._closed = self._closed or closed
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(WorkerDead(reason))
        if first and self.on_death is not None:
            self.on_death(WorkerDead(reason))
