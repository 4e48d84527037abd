"""`radixserve-loadtest soak`: a bounded mix of valid and hostile requests against a running server,
with the server's health sampled over time.

C workers cycle through a fixed mix (valid requests, too many inputs, too long without
truncation, malformed JSON, a wrong content type, a body announced past the default payload limit
(the answer is read before any body byte is sent, see ``_oversized``), and two kinds of client
disconnect); every ``interval`` seconds a sampler records the server's
RSS and open fds (from /proc/PID when ``--pid`` is given, else from /metrics ``process_*`` series
when the server exports them) and re-embeds (or re-scores) fixed inputs, which must stay within
1e-5 of the first answer. With ``churn`` the valid requests carry inputs that differ from request
to request in content, count and length (seeded by the request's number, so a run repeats), the
load that makes a prefix cache evict and an allocator fragment. Writes soak.json and soak.md, with
RSS start, peak, end and slope (loadtest.soak_rss) and the valid requests served per second. Bounds: loopback targets only; it stops by
itself after ``duration`` (plus one request timeout) or ``max_requests``, whichever comes first.
"""
from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from loadtest.client import check_url
from loadtest.soak_rss import rss_markdown, rss_summary
from loadtest.wordlist import WORDS

DRIFT_TOL = 1e-5
_LOOPBACK = ("127.0.0.1", "::1", "localhost")
_PAD_BYTES = 2_100_000  # past the default --payload-limit (2 MB); valid JSON if a server accepts it
# The cycle each worker walks; valid requests are half of it. Worker w starts at slot 2w + 1, so
# with 7 workers every hostile kind is among the first requests.
MIX = ("valid", "too_many_inputs", "valid", "too_long", "valid", "malformed_json", "valid", "wrong_type",
       "valid", "oversized_body", "valid", "disconnect_early", "valid", "disconnect_after_send")
_CHURN_MAX_WORDS = 256  # words per churned input at most (about as many tokens)
PROBE_TEXTS = ("soak probe: the quick brown fox", "a second fixed input, a little longer than the first", "3")


@dataclass(frozen=True)
class SoakConfig:
    url: str
    duration_s: float
    concurrency: int = 4
    interval_s: float = 1.0
    pid: int | None = None
    max_requests: int = 100_000
    timeout_s: float = 30.0
    churn: bool = False


@dataclass
class Sample:
    t_s: float  # since the start
    rss_bytes: int | None
    open_fds: int | None
    drift: float | None  # max abs difference of the probe's answer from the first one
    requests: int  # sent so far
    health: int | None  # GET /health status


@dataclass
class SoakResult:
    config: dict
    kind: str
    statuses: dict[str, dict[str, int]]  # request kind -> status (or error name) -> count
    samples: list[Sample] = field(default_factory=list)
    max_drift: float = 0.0
    problems: list[str] = field(default_factory=list)
    rss: dict | None = None  # loadtest.soak_rss.rss_summary
    valid_per_s: float = 0.0  # valid requests answered 200, per second of the run

    @property
    def ok(self) -> bool:
        return not self.problems


def check_loopback(url: str) -> str:
    url = check_url(url)
    host = httpx.URL(url).host
    if host not in _LOOPBACK:
        raise ValueError(f"soak only targets a server on this machine (127.0.0.1, ::1, localhost), got {host!r}")
    return url


def proc_stats(pid: int) -> tuple[int | None, int | None]:
    """(VmRSS bytes, open fds) of a local process; None where /proc does not say."""
    rss = fds = None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        pass
    return rss, fds


def metrics_stats(text: str) -> tuple[int | None, int | None]:
    """(process_resident_memory_bytes, process_open_fds) from Prometheus text, if exported."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("process_resident_memory_bytes", "process_open_fds"):
            try:
                found[name] = int(float(value.split()[0]))
            except (ValueError, IndexError):
                pass
    return found.get("process_resident_memory_bytes"), found.get("process_open_fds")


def _churn_texts(i: int, max_words: int) -> list[str]:
    """1-4 inputs, each a cut of one of 8 shared heads plus a random tail, all seeded by ``i``."""
    rng = random.Random(i)
    texts = []
    for _ in range(rng.randint(1, 4)):
        head = rng.randrange(8)
        head_words = [WORDS[(head * 97 + k * 13) % len(WORDS)] for k in range(rng.randint(0, 64))]
        tail = rng.choices(WORDS, k=rng.randint(1, max(1, max_words - len(head_words))))
        texts.append(" ".join(head_words + tail))
    return texts


def _valid(kind: str, i: int, *, churn: bool = False, max_words: int = 256) -> tuple[str, dict]:
    if churn:
        texts = _churn_texts(i, max_words)
        if kind == "reranker":
            return "/rerank", {"query": texts[0][:200], "texts": texts, "truncate": True}
        return "/embed", {"inputs": texts, "truncate": True}
    if kind == "reranker":
        return "/rerank", {"query": f"soak query {i % 7}", "texts": [f"passage {i % 5}", "another passage"]}
    return "/embed", {"inputs": [f"soak input {i % 11}", "a shared prefix and a tail"]}


def _body(which: str, kind: str, info: dict, i: int, *, churn: bool = False) -> tuple[str, bytes, str]:
    """(route, body bytes, content type) of one request of the mix."""
    max_words = max(8, min(_CHURN_MAX_WORDS, int(info.get("max_input_length") or 512) // 2))
    route, payload = _valid(kind, i, churn=churn and which == "valid", max_words=max_words)
    field_name = "texts" if kind == "reranker" else "inputs"
    if which == "too_many_inputs":
        payload[field_name] = ["x"] * (int(info.get("max_client_batch_size") or 2048) + 1)
    elif which == "too_long":
        payload[field_name] = ["word " * (int(info.get("max_input_length") or 512) + 8)]
        payload["truncate"] = False
    elif which == "malformed_json":
        return route, b'{"inputs": ["unterminated', "application/json"
    elif which == "wrong_type":
        return route, json.dumps(payload).encode(), "text/plain"
    elif which == "oversized_body":
        return route, json.dumps(payload).encode() + b" " * _PAD_BYTES, "application/json"
    return route, json.dumps(payload).encode(), "application/json"


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:  # the server may have reset the connection first
        pass


async def _oversized(url: str, route: str, length: int, *, timeout_s: float) -> str:
    """Announce a ``length``-byte body and read the answer's status before sending any of it.

    NOTE: a server that refuses from Content-Length answers and closes without reading the body;
    a client still writing it then races the kernel, which resets a socket closed with unread data
    (the client may see the reset, not the 413). Reading first measures the refusal, not that race.
    """
    u = httpx.URL(url)
    reader, writer = await asyncio.open_connection(u.host, u.port or 80)
    try:
        writer.write((f"POST {route} HTTP/1.1\r\nHost: {u.host}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {length}\r\n\r\n").encode())
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout_s)  # b"HTTP/1.1 413 ..."
    except asyncio.TimeoutError:  # NOTE: not an OSError before Python 3.11
        return "TimeoutError"  # the server waited for the body instead of refusing
    finally:
        await _close(writer)
    parts = line.split()
    return parts[1].decode("ascii", "replace") if len(parts) >= 2 else "closed"


async def _disconnect(url: str, route: str, body: bytes, *, after_send: bool) -> str:
    """Send a request and hang up: before the body is complete, or right after sending it."""
    u = httpx.URL(url)
    reader, writer = await asyncio.open_connection(u.host, u.port or 80)
    try:
        head = (f"POST {route} HTTP/1.1\r\nHost: {u.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        writer.write(head + (body if after_send else body[: len(body) // 2]))
        await writer.drain()
        if after_send:
            await asyncio.sleep(0.01)  # long enough for the server to start on it
    finally:
        await _close(writer)
    return "closed"


class _Soak:
    def __init__(self, config: SoakConfig, kind: str, info: dict) -> None:
        self.c, self.kind, self.info = config, kind, info
        self.statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.sent = 0
        self.deadline = time.monotonic() + config.duration_s

    def _more(self) -> bool:
        return time.monotonic() < self.deadline and self.sent < self.c.max_requests

    async def worker(self, client: httpx.AsyncClient, w: int) -> None:
        i = 2 * w + 1
        while self._more():
            which = MIX[i % len(MIX)]
            i += 1
            self.sent += 1
            route, body, ctype = _body(which, self.kind, self.info, i, churn=self.c.churn)
            try:
                if which.startswith("disconnect"):
                    outcome = await _disconnect(self.c.url, route, body, after_send=which.endswith("after_send"))
                elif which == "oversized_body":
                    outcome = await _oversized(self.c.url, route, len(body), timeout_s=self.c.timeout_s)
                else:
                    r = await client.post(self.c.url + route, content=body, headers={"content-type": ctype})
                    outcome = str(r.status_code)
            except (httpx.HTTPError, OSError) as exc:
                outcome = type(exc).__name__
            self.statuses[which][outcome] += 1

    async def probe(self, client: httpx.AsyncClient) -> list[float] | None:
        if self.kind == "reranker":
            r = await client.post(self.c.url + "/rerank", json={"query": PROBE_TEXTS[0], "texts": list(PROBE_TEXTS),
                                                               "raw_scores": True})
            return [x["score"] for x in sorted(r.json(), key=lambda x: x["index"])] if r.status_code == 200 else None
        r = await client.post(self.c.url + "/embed", json={"inputs": list(PROBE_TEXTS)})
        return [v for row in r.json() for v in row] if r.status_code == 200 else None

    async def sampler(self, client: httpx.AsyncClient, result: SoakResult, t0: float) -> None:
        first: list[float] | None = None
        while True:
            rss = fds = None
            if self.c.pid is not None:
                rss, fds = proc_stats(self.c.pid)
            else:
                try:
                    rss, fds = metrics_stats((await client.get(self.c.url + "/metrics")).text)
                except httpx.HTTPError:
                    pass
            drift = health = None
            try:
                health = (await client.get(self.c.url + "/health")).status_code
                answer = await self.probe(client)
                if answer is None:
                    result.problems.append(f"the drift probe failed at {time.monotonic() - t0:.1f} s")
                elif first is None:
                    first, drift = answer, 0.0
                elif len(answer) != len(first):
                    result.problems.append("the drift probe's answer changed shape")
                else:
                    drift = max(abs(a - b) for a, b in zip(answer, first))
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                result.problems.append(f"sampling failed: {type(exc).__name__}")
            result.samples.append(Sample(round(time.monotonic() - t0, 3), rss, fds, drift, self.sent, health))
            if not self._more():
                return
            await asyncio.sleep(min(self.c.interval_s, max(0.0, self.deadline - time.monotonic())))


async def soak(config: SoakConfig) -> SoakResult:
    """Run the soak (see the module docstring) and judge it."""
    url = check_loopback(config.url)
    config = SoakConfig(**{**asdict(config), "url": url})
    timeout = httpx.Timeout(config.timeout_s)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=config.concurrency + 2)) as client:
        info = (await client.get(url + "/info")).json()
        kind = "reranker" if "reranker" in (info.get("model_type") or {}) else "embedding"
        run = _Soak(config, kind, info)
        result = SoakResult(config=asdict(config), kind=kind, statuses={})
        t0 = time.monotonic()
        bound = config.duration_s + 2 * config.timeout_s  # nothing outlives this
        await asyncio.wait_for(asyncio.gather(run.sampler(client, result, t0),
                                              *(run.worker(client, w) for w in range(config.concurrency))), bound)
        elapsed = time.monotonic() - t0
    result.statuses = {k: dict(v) for k, v in sorted(run.statuses.items())}
    result.rss = rss_summary(result.samples)
    result.valid_per_s = round(result.statuses.get("valid", {}).get("200", 0) / max(elapsed, 1e-9), 2)
    _judge(result)
    return result


def _judge(result: SoakResult) -> None:
    drifts = [s.drift for s in result.samples if s.drift is not None]
    result.max_drift = max(drifts, default=0.0)
    if result.max_drift > DRIFT_TOL:
        result.problems.append(f"output drift {result.max_drift:.2e} > {DRIFT_TOL:g}")
    for which, counts in result.statuses.items():
        if any(code.startswith("5") for code in counts):
            result.problems.append(f"{which}: server errors {counts}")
        if which == "valid" and set(counts) - {"200", "429"}:
            result.problems.append(f"valid requests answered {counts}")
    if result.samples and result.samples[-1].health != 200:
        result.problems.append(f"/health answered {result.samples[-1].health} at the end")


def markdown(result: SoakResult) -> str:
    c = result.config
    lines = [f"# radixserve soak: {c['url']}", "",
             f"{c['duration_s']:g} s, {c['concurrency']} workers, a sample every {c['interval_s']:g} s, "
             f"model kind {result.kind}{', churning inputs' if c.get('churn') else ''}; "
             f"verdict: **{'ok' if result.ok else 'problems'}**", "",
             f"Valid requests served: {result.valid_per_s:.2f}/s.", *rss_markdown(result.rss), ""]
    lines += [f"- {p}" for p in result.problems] + ([""] if result.problems else [])
    lines += ["| request | answers |", "|---|---|"]
    lines += [f"| {k} | {', '.join(f'{s}: {n}' for s, n in sorted(v.items()))} |" for k, v in result.statuses.items()]
    lines += ["", "| t (s) | RSS (MiB) | open fds | drift | requests | /health |", "|---|---|---|---|---|---|"]
    for s in result.samples:
        rss = f"{s.rss_bytes / 2**20:.1f}" if s.rss_bytes is not None else "-"
        drift = f"{s.drift:.1e}" if s.drift is not None else "-"
        lines.append(f"| {s.t_s:.1f} | {rss} | {s.open_fds if s.open_fds is not None else '-'} | {drift} | "
                     f"{s.requests} | {s.health if s.health is not None else '-'} |")
    return "\n".join(lines) + "\n"


def write(result: SoakResult, out: str | Path) -> tuple[Path, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = {**{k: v for k, v in asdict(result).items()}, "ok": result.ok}
    js, md = out / "soak.json", out / "soak.md"
    js.write_text(json.dumps(data, indent=2))
    md.write_text(markdown(result))
    return js, md
