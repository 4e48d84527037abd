"""The engine process of ``--api-server-count N`` (N > 1): the model, the scheduler, the front ends.

``serve(config, runner)`` binds the API port (sockets.py), starts the scheduler, starts N front
ends (``python -m server.frontends.frontend``, each in a session of its own so a terminal's
Ctrl-C reaches the engine alone) and serves their submits: each is queued on this loop
(``Scheduler.enqueue``, no task of its own) and answered from its ticket's done callback with
the outputs or the error's kind (wire.py); a cancel cancels the ticket. It also gathers /metrics
for any front end (its own series plus every front end's, summed) and serves --prometheus-port.

Life and death, one rule each:
- SIGTERM/SIGINT: the engine passes SIGTERM to every front end, which stops accepting and lets
  its in-flight requests finish (its own drain, --graceful-shutdown-timeout); once all have
  exited the scheduler is stopped and the engine exits 0. A second signal is passed on too
  (the front ends then exit at once).
- The model worker dies: the front ends are told (their /health turns 503, they drain and exit
  non-zero), then the engine exits ``EXIT_WORKER_DEAD``.
- A front end exits on its own (a crash, a kill): the engine logs it, drains the others and
  exits ``EXIT_WORKER_DEAD``; the supervisor (Docker, Kubernetes, systemd) restarts the server.
- The engine is gone (killed): each front end sees the end of its socket, answers 503, drains
  and exits ``EXIT_WORKER_DEAD``.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field

from scheduler import BatchFailed, Scheduler, SubmitResult, WorkerDead
from scheduler.scheduler import Ticket
from scheduler.metrics import Metrics
from server.config import ServerConfig
from server.frontends import metrics_merge, wire
from server.frontends.sockets import bind_api, bind_side
from server.frontends.view import RunnerView
from server.http.lifecycle import EXIT_WORKER_DEAD
from server.service.contract import ServedRunner

log = logging.getLogger("radixserve.server")

COLLECT_TIMEOUT_S = 5.0  # a front end that does not answer a metrics collection in time is left out


@dataclass
class FrontEnd:
    index: int
    proc: subprocess.Popen
    channel: wire.Channel = field(init=False)
    tickets: dict[int, Ticket] = field(default_factory=dict)  # its submits not yet answered, by id
    gone: bool = False


class Engine:
    def __init__(self, config: ServerConfig, runner: ServedRunner, metrics: Metrics) -> None:
        self.config, self.runner, self.metrics = config, runner, metrics
        self.frontends: list[FrontEnd] = []
        self.stopping = False
        self.exit_code = 0
        self.scheduler: Scheduler | None = None
        self._collects: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._done: asyncio.Event | None = None

    # -- start ----------------------------------------------------------------------------------
    async def run(self) -> int:
        from server.app import build_scheduler

        loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        config = self.config
        tcp, uds = bind_api(hostname=config.hostname, port=config.port, count=config.api_server_count,
                            uds_path=config.uds_path)
        side = (bind_side(hostname=config.prometheus_hostname or config.hostname, port=config.prometheus_port)
                if config.prometheus_port is not None else None)

        def on_death(exc: BaseException) -> None:  # the pipeline's thread
            loop.call_soon_threadsafe(self._worker_died, exc)

        self.scheduler = build_scheduler(config, self.runner, self.metrics, on_death=on_death)
        self.scheduler.start()
        view = RunnerView.of(self.runner)
        port = tcp[0].getsockname()[1]
        try:
            for i, sock in enumerate(tcp):
                self.frontends.append(await self._spawn(i, sock, uds, view))
        finally:
            for sock in tcp:
                sock.close()  # the front ends hold them now: a front end's exit closes its listener
            if uds is not None:
                uds.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        metrics_server = await self._serve_side(side) if side is not None else None
        loop.create_task(self._send_startup())
        log.info("engine (pid %d) serving through %d front ends on %s:%d; --max-concurrent-requests %d per front "
                 "end, %d in all", os.getpid(), len(self.frontends), config.hostname, port,
                 config.max_concurrent_requests, config.max_concurrent_requests * len(self.frontends))
        await self._done.wait()
        if metrics_server is not None:
            metrics_server.force_exit = True
            await metrics_server.shutdown()
        if config.uds_path and os.path.exists(config.uds_path):
            os.unlink(config.uds_path)
        return self.exit_code

    async def _send_startup(self) -> None:
        """/info's ``startup`` in the front ends: the engine's stages once the warm-up has ended."""
        seconds = getattr(getattr(self.runner, "startup", None), "seconds", None)
        if seconds is None:
            return
        while "total" not in seconds and not self.stopping:
            await asyncio.sleep(0.2)
        for fe in self.frontends:
            if not fe.gone:
                fe.channel.send(("startup", dict(seconds)))

    async def _spawn(self, index: int, sock: socket.socket, uds: socket.socket | None, view: RunnerView) -> FrontEnd:
        mine, theirs = socket.socketpair()
        fds = [theirs.fileno(), sock.fileno(), *([uds.fileno()] if uds is not None else [])]
        proc = subprocess.Popen([sys.executable, "-m", "server.frontends.frontend", *map(str, fds)],
                                pass_fds=fds, start_new_session=True)
        theirs.close()
        fe = await self.connect(index, proc, mine)
        assert self.scheduler is not None
        fe.channel.send(("hello", {"config": self.config, "view": view, "index": index,
                                   "alive": self.scheduler.alive}))
        log.info("front end %d started (pid %d)", index, proc.pid)
        return fe

    async def connect(self, index: int, proc: subprocess.Popen, sock: socket.socket) -> FrontEnd:
        """Serve front end ``index`` (process ``proc``) on ``sock``, the engine's end of its pair."""
        fe = FrontEnd(index, proc)

        def made() -> wire.Channel:  # set before any message arrives
            fe.channel = wire.Channel(lambda msg: self._on_message(fe, msg), lambda exc: self._on_lost(fe))
            return fe.channel

        await asyncio.get_running_loop().create_connection(made, sock=sock)
        return fe

    async def _serve_side(self, sock: socket.socket):
        """--prometheus-port: /metrics (every process, summed) and /health, on this loop."""
        import uvicorn

        from server.http.listener import uvicorn_config
        from server.http.metrics_listener import metrics_app

        holder = _Latest()
        registry = _registry_of(holder)
        inner = metrics_app(registry, healthy=lambda: self.scheduler is not None and self.scheduler.alive
                            and not self.stopping)

        async def app(scope, receive, send) -> None:
            if scope["type"] == "http" and scope.get("path") == "/metrics":
                holder.families = await self.gather()
            await inner(scope, receive, send)

        server = uvicorn.Server(uvicorn_config(app, stack=self.config.http_stack,
                                               header_timeout_s=self.config.header_read_timeout, log_config=None,
                                               lifespan="off"))
        server.config.load()
        server.lifespan = server.config.lifespan_class(server.config)
        await server.startup(sockets=[sock])
        return server

    # -- serving a front end --------------------------------------------------------------------
    def _on_message(self, fe: FrontEnd, msg: tuple) -> None:
        kind = msg[0]
        if kind == "submit":
            self._submit(fe, *msg[1:])
        elif kind == "cancel":
            ticket = fe.tickets.pop(msg[1], None)
            if ticket is not None and self.scheduler is not None:
                self.scheduler.cancel(ticket)
        elif kind == "scrape":
            asyncio.get_running_loop().create_task(self._scrape(fe, msg[1]))
        elif kind == "ping":  # answered on this loop: a stopped or stuck engine answers nothing
            fe.channel.send(("pong", msg[1], self.scheduler is not None and self.scheduler.alive and not self.stopping))
        elif kind == "collected":
            future = self._collects.pop(msg[1], None)
            if future is not None and not future.done():
                future.set_result(msg[2])
        else:
            log.error("front end %d sent an unknown message %r", fe.index, kind)

    def _on_lost(self, fe: FrontEnd) -> None:
        """The front end's end of the pair closed (it exited, or is exiting): reap it."""
        fe.gone = True
        tickets, fe.tickets = list(fe.tickets.values()), {}
        for ticket in tickets:
            if self.scheduler is not None:
                self.scheduler.cancel(ticket)
        asyncio.get_running_loop().create_task(self._reap(fe))

    async def _reap(self, fe: FrontEnd) -> None:
        code = await asyncio.get_running_loop().run_in_executor(None, fe.proc.wait)
        if not self.stopping:
            log.error("front end %d (pid %d) exited with status %d: stopping the server (exit status %d); "
                      "its supervisor restarts it", fe.index, fe.proc.pid, code, EXIT_WORKER_DEAD)
            self.stop(f"front end {fe.index} exited", exit_code=EXIT_WORKER_DEAD, signal_frontends=True)
        else:
            log.info("front end %d (pid %d) exited with status %d", fe.index, fe.proc.pid, code)

    def _submit(self, fe: FrontEnd, sid: int, items: list[list[int]], request_id: str | None,
                all_tokens: bool, namespace: bytes) -> None:
        """Queue a front end's submit; ``_answer`` replies once its outcome is in (no task of its own)."""
        assert self.scheduler is not None
        try:
            ticket = self.scheduler.enqueue(items, request_id=request_id, all_tokens=all_tokens, namespace=namespace)
        except Exception as exc:  # noqa: BLE001 - refused (worker gone, a malformed submit): its request only
            self._reply(fe, sid, request_id, None, exc)
            return
        fe.tickets[sid] = ticket
        ticket.future.add_done_callback(functools.partial(self._answer, fe, sid, request_id))

    def _answer(self, fe: FrontEnd, sid: int, request_id: str | None, future: asyncio.Future) -> None:
        fe.tickets.pop(sid, None)
        if future.cancelled():
            return  # the front end cancelled it, or is gone: nobody waits for an answer
        exc = future.exception()
        self._reply(fe, sid, request_id, None if exc is not None else future.result(), exc)

    def _reply(self, fe: FrontEnd, sid: int, request_id: str | None, result: SubmitResult | None,
               exc: BaseException | None) -> None:
        if isinstance(exc, BatchFailed):
            reply: tuple = ("error", sid, "batch", str(exc))
        elif isinstance(exc, WorkerDead):
            reply = ("error", sid, "dead", str(exc))
        elif exc is not None:
            log.error("request id %s: %s: %s", request_id, type(exc).__name__, exc)
            reply = ("error", sid, "batch", f"{type(exc).__name__}: {exc}")
        else:
            assert result is not None
            reply = ("result", sid, wire.pack_outputs(result.outputs), result.queue_time_s,
                     result.inference_time_s, result.compute_tokens)
        if not fe.gone:
            try:
                fe.channel.send(reply)
            except Exception as exc:  # noqa: BLE001 - an answer that does not pickle fails its request only
                log.error("request id %s: the answer does not pickle: %s: %s", request_id, type(exc).__name__, exc)
                fe.channel.send(("error", sid, "batch", f"{type(exc).__name__}: {exc}"))

    async def _scrape(self, fe: FrontEnd, sid: int) -> None:
        families = await self.gather()
        if not fe.gone:
            fe.channel.send(("scraped", sid, families))

    async def gather(self) -> list:
        """The engine's metric families and every live front end's, summed (metrics_merge.py)."""
        loop = asyncio.get_running_loop()
        asks = []
        for fe in self.frontends:
            if not fe.gone:
                cid = next(self._ids)
                self._collects[cid] = future = loop.create_future()
                fe.channel.send(("collect", cid))
                asks.append((cid, future))
        if asks:
            await asyncio.wait([f for _, f in asks], timeout=COLLECT_TIMEOUT_S)
        answers = [f.result() for _, f in asks if f.done() and not f.cancelled()]
        for cid, _ in asks:
            self._collects.pop(cid, None)
        if self.scheduler is not None:
            self.metrics.queue_size.set(self.scheduler.queue_size)
        return metrics_merge.merge([list(self.metrics.registry.collect()), *answers])

    # -- stopping -------------------------------------------------------------------------------
    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.stopping:
            log.warning("second %s: the front ends exit now", name)
            self._signal_all(signal.SIGTERM)
            return
        self.stop(f"received {name}", signal_frontends=True)

    def _worker_died(self, exc: BaseException) -> None:
        log.error("the model worker died (%s: %s): the front ends drain, then the server exits with status %d",
                  type(exc).__name__, exc, EXIT_WORKER_DEAD)
        for fe in self.frontends:
            if not fe.gone:
                fe.channel.send(("dead", "the model worker died"))
        self.stop("the model worker died", exit_code=EXIT_WORKER_DEAD)

    def stop(self, reason: str, *, exit_code: int = 0, signal_frontends: bool = False) -> None:
        """Begin the shutdown: the front ends drain and exit, then the scheduler stops."""
        self.exit_code = max(self.exit_code, exit_code)
        if self.stopping:
            return
        self.stopping = True
        log.warning("stopping (%s): the front ends finish their requests, then the engine stops", reason)
        if signal_frontends:  # not after a dead worker: the front ends drain on the "dead" message
            self._signal_all(signal.SIGTERM)
        asyncio.get_running_loop().create_task(self._finish())

    def _signal_all(self, sig: int) -> None:
        for fe in self.frontends:
            if fe.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    fe.proc.send_signal(sig)

    async def _finish(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.graceful_shutdown_timeout + 5.0
        while any(fe.proc.poll() is None for fe in self.frontends) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self._signal_all(signal.SIGKILL)  # none left unless one outlived its own deadline
        if self.scheduler is not None:
            scheduler = self.scheduler
            log.info("shutting down: stopping the scheduler")
            await loop.run_in_executor(None, lambda: scheduler.stop(drain=True, timeout=5.0))
        assert self._done is not None
        self._done.set()


class _Latest:
    """The families the last scrape gathered (the side server's registry renders them)."""

    def __init__(self) -> None:
        self.families: list = []


def _registry_of(holder: _Latest):
    from prometheus_client import CollectorRegistry

    class _Collector:
        def collect(self):
            return iter(holder.families)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return registry


def serve(config: ServerConfig, runner: ServedRunner) -> int:
    """Run the engine until it stops; the exit status (0 after a signal)."""
    from server.http.listener import resolve_stack

    metrics = Metrics()
    metrics.watch_prefix_cache(runner.prefix_cache)
    engine = Engine(config, runner, metrics)
    if resolve_stack(config.http_stack) == "httptools":
        import uvloop

        return uvloop.run(engine.run())
    return asyncio.run(engine.run())
