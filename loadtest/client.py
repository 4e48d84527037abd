"""Closed-loop async HTTP load generator: `concurrency` workers, each sends its next request as soon
as the previous one answers, until `requests` are sent or `duration` seconds pass.

The warm-up sends `warmup` requests one at a time, unmeasured, none of which the measured run
sends: `RunConfig.warmup_requests` (the CLI builds them from the data set with every text marked,
workloads.warmup_dataset), or else the list's first ones with their texts marked
(workloads.marked). A replayed request would be read whole from a prefix cache and inflate the
server's figures. The measured run starts at the first request, or with `warmup_continues` at the
one after the warm-up's count (see `measured_requests`).
Only successful answers (HTTP 200 with one result per input item) enter the latency sample;
everything else is counted by status ("429", "500", "connection", "timeout", "bad-response").
/metrics is scraped after the warm-up and after the run so the server-side deltas cover exactly the
measured requests.

The client must never be what limits a run: answers of more than OFF_LOOP_BYTES are checked on a
worker thread (a 64-item float answer of a 1024-wide model is ~1.3 MB of JSON), requests may ask
for base64 vectors (`encoding_format: base64`, workloads.build_requests' `encoding`), and the run
records the client's own CPU seconds (`client_cpu_s`; a share near one core means the client, not
the server, set the pace). loadtest.responder measures the client's ceiling against a server that
does no work.
"""
from __future__ import annotations

import asyncio
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from loadtest import scrape
from loadtest.workloads import Request, expected_count, marked


@dataclass(frozen=True)
class RunConfig:
    url: str
    concurrency: int = 8
    requests: int | None = None  # stop after this many (None: one pass when no duration either)
    duration: float | None = None  # seconds
    warmup: int = 2
    timeout: float = 120.0
    progress: bool = True
    api_key: str | None = None
    metrics_urls: tuple[str, ...] = ()  # servers whose /metrics deltas add up (a router's replicas); () = url
    warmup_continues: bool = False  # the measured run cycles over the requests after the warm-up's
    warmup_requests: tuple[Request, ...] = ()  # what the warm-up sends (cycled); () = the list's first, marked


@dataclass
class RunResult:
    latencies_s: list[float] = field(default_factory=list)  # successful requests, in completion order
    completions_s: list[float] = field(default_factory=list)  # completion offsets from start, same order
    errors: Counter = field(default_factory=Counter)  # status -> count
    items_ok: int = 0
    sent: int = 0
    distinct: int = 0  # requests in the list; sent > distinct means the list repeated
    wall_s: float = 0.0
    client_cpu_s: float = 0.0  # this process's CPU seconds over the measured run (all its threads)
    metrics: scrape.MetricsDelta = field(default_factory=lambda: scrape.delta(None, None))

    @property
    def ok(self) -> int:
        return len(self.latencies_s)


def check_url(url: str) -> str:
    """An explicit http(s) URL with a host; returns it without a trailing slash."""
    u = httpx.URL(url)
    if u.scheme not in ("http", "https") or not u.host:
        raise ValueError(f"need an explicit http(s)://host:port URL, got {url!r}")
    return str(url).rstrip("/")


OFF_LOOP_BYTES = 256 * 1024  # answers larger than this are parsed on a worker thread


def _answer_ok(resp: httpx.Response, req: Request) -> bool:
    """One result per input item; for a base64 request, vectors that came back as strings."""
    try:
        data = resp.json()
    except ValueError:
        return False
    if req.route in ("/v1/embeddings", "/pooling", "/classify"):  # answers wrapped as {data: [...]}
        data = data.get("data") if isinstance(data, dict) else None
    if not (isinstance(data, list) and len(data) == expected_count(req.body)):
        return False
    if req.body.get("encoding_format") == "base64":
        return all(isinstance(d, dict) and isinstance(d.get("embedding"), str) for d in data)
    return True


def warmup_requests(requests: list[Request], cfg: RunConfig) -> list[Request]:
    """The `cfg.warmup` requests the warm-up sends: none of them is a measured request."""
    pool = list(cfg.warmup_requests) or [marked(r) for r in requests[: cfg.warmup]]
    return [pool[i % len(pool)] for i in range(cfg.warmup)] if pool else []


def measured_requests(requests: list[Request], cfg: RunConfig) -> list[Request]:
    """The list the measured run cycles over: all of `requests`, or with `cfg.warmup_continues`
    those after the warm-up's first `cfg.warmup` (ValueError when none is left)."""
    if not cfg.warmup_continues:
        return requests
    if cfg.warmup >= len(requests):
        raise ValueError(f"--warmup-continues: the warm-up takes {cfg.warmup} of {len(requests)} requests, "
                         "none is left to measure")
    return requests[cfg.warmup:]


async def scrape_metrics(client: httpx.AsyncClient, url: str) -> scrape.Snapshot | None:
    """GET /metrics parsed, or None when the target has none (or it cannot be read)."""
    try:
        r = await client.get(url + "/metrics")
        return scrape.parse(r.text) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


PROGRESS_INTERVAL_S = 1.0  # how often a --duration run redraws its status line


def _clock(seconds: float, *, up: bool = False) -> str:
    """M:SS, rounded down (elapsed) or up (`up`: time left, so 0:00 means done)."""
    s = math.ceil(seconds) if up else math.floor(seconds)
    return f"{s // 60}:{s % 60:02d}"


class Progress:
    """Progress on stderr, drawn only when stderr is a terminal (logs and pipes stay clean).

    Runs with a duration get a status line redrawn every PROGRESS_INTERVAL_S by `tick` (elapsed,
    time left, requests done, errors); other runs get tqdm when installed, else the same line
    without the time (at most every 0.5 s)."""

    def __init__(self, enabled: bool, *, total: int | None, duration: float | None):
        self.stream = sys.stderr  # looked up per run, so a test can swap it
        self.enabled = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self.total, self.duration = total, duration
        self.bar, self.n, self.errors, self.last, self.width = None, 0, 0, 0.0, 0
        self.start = time.perf_counter()
        if self.enabled and duration is None:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="req", file=self.stream, leave=False)
            except ImportError:
                pass

    def update(self, errors: int) -> None:
        self.n, self.errors = self.n + 1, errors
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(errors=errors, refresh=False)
        elif self.enabled and self.duration is None and time.perf_counter() - self.last > 0.5:
            self.last = time.perf_counter()
            self._draw()

    def _draw(self) -> None:
        done = f"{self.n}/{self.total}" if self.total is not None else str(self.n)
        line = f"{done} requests, {self.errors} errors"
        if self.duration is not None:
            elapsed = time.perf_counter() - self.start
            left = max(0.0, self.duration - elapsed)
            line = f"{_clock(elapsed)} / {_clock(self.duration, up=True)}, {_clock(left, up=True)} left, " + line
        # Pad to the previous width so a shorter line leaves no stale characters behind.
        self.width = max(self.width, len(line))
        print("\r" + line.ljust(self.width), end="", file=self.stream, flush=True)

    async def tick(self) -> None:
        """Redraw every PROGRESS_INTERVAL_S until cancelled (duration runs only)."""
        if not (self.enabled and self.duration is not None):
            return
        while True:
            self._draw()
            await asyncio.sleep(PROGRESS_INTERVAL_S)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            self._draw()
            print(file=self.stream)


class TargetDown(RuntimeError):
    """Nothing usable answers at a target URL (the message says what was tried)."""


def probe(url: str, *, timeout: float = 5.0) -> None:
    """One GET /health before a run: raise TargetDown when nothing answers HTTP at `url` (refused,
    unreachable, timed out) or it answers 5xx (a server whose worker is down). Any other status
    counts as alive: a peer without /health answers 404, one behind auth may answer 401."""
    url = check_url(url)
    try:
        r = httpx.get(url + "/health", timeout=timeout)
    except httpx.TimeoutException:
        raise TargetDown(f"no answer from {url} within {timeout:g} s (GET /health); is the server up?") from None
    except httpx.TransportError as e:
        raise TargetDown(f"nothing answers at {url} ({type(e).__name__}: {e}); start the server there "
                         "or fix the URL") from None
    if r.status_code >= 500:
        raise TargetDown(f"{url} answers but is not healthy: GET /health -> HTTP {r.status_code}")


async def send(client: httpx.AsyncClient, url: str, req: Request) -> tuple[str, float]:
    """POST one request; (status, seconds until the answer was read and checked). status is "ok",
    the HTTP status of a non-200 answer, "bad-response", "timeout" or "connection"."""
    t0 = time.perf_counter()
    try:
        resp = await client.post(url + req.route, json=req.body)
        if resp.status_code != 200:
            status = str(resp.status_code)
        else:
            # a big answer is parsed off the event loop, so the other workers keep sending
            ok = (await asyncio.to_thread(_answer_ok, resp, req) if len(resp.content) > OFF_LOOP_BYTES
                  else _answer_ok(resp, req))
            status = "ok" if ok else "bad-response"
    except httpx.TimeoutException:
        status = "timeout"
    except httpx.TransportError:
        status = "connection"
    except httpx.HTTPError:  # e.g. an undecodable body: counted, never ends the run
        status = "bad-response"
    return status, time.perf_counter() - t0


def record(res: RunResult, req: Request, status: str, seconds: float, completed_at: float) -> None:
    """Enter one answer in `res`: a latency sample when ok, else an error count by status."""
    if status == "ok":
        res.latencies_s.append(seconds)
        res.completions_s.append(completed_at)
        res.items_ok += req.items
    else:
        res.errors[status] += 1


async def run_async(requests: list[Request], cfg: RunConfig) -> RunResult:
    if not requests:
        raise ValueError("no requests to send")
    if cfg.concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    url = check_url(cfg.url)
    measured = measured_requests(requests, cfg)
    limit = cfg.requests if cfg.requests is not None else (None if cfg.duration else len(measured))
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    res = RunResult(distinct=len(measured))
    pool = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
    async with httpx.AsyncClient(timeout=cfg.timeout, limits=pool, headers=headers) as client:
        for req in warmup_requests(requests, cfg):  # answers not checked: they are not measured
            await send(client, url, req)
        metrics_urls = cfg.metrics_urls or (url,)
        before = [await scrape_metrics(client, u) for u in metrics_urls]
        progress = Progress(cfg.progress, total=limit, duration=cfg.duration)
        ticker = asyncio.create_task(progress.tick())
        start = progress.start = time.perf_counter()
        cpu0 = time.process_time()
        deadline = start + cfg.duration if cfg.duration else None
        counter = iter(range(sys.maxsize))

        async def worker() -> None:
            while True:
                i = next(counter)
                if (limit is not None and i >= limit) or (deadline is not None and time.perf_counter() >= deadline):
                    return
                req = measured[i % len(measured)]
                res.sent += 1
                status, seconds = await send(client, url, req)
                record(res, req, status, seconds, time.perf_counter() - start)
                progress.update(sum(res.errors.values()))

        try:
            await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
        finally:
            res.wall_s = time.perf_counter() - start
            res.client_cpu_s = time.process_time() - cpu0
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
            progress.close()
        after = [await scrape_metrics(client, u) for u in metrics_urls]
    res.metrics = scrape.combine([scrape.delta(b, a) for b, a in zip(before, after)])
    return res


def run(requests: list[Request], cfg: RunConfig) -> RunResult:
    return asyncio.run(run_async(requests, cfg))


def wait_healthy(url: str, *, timeout: float = 300.0, alive=None) -> None:
    """Poll GET /health until 200. `alive()` returning False (a dead server process) aborts early."""
    url = check_url(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise RuntimeError(f"server for {url} exited before becoming healthy")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url}/health not ready after {timeout:.0f} s")
