"""Answer bodies as JSON bytes: vectorised float encoding, built in short steps, off the loop when big.

Float JSON: a float32 value is written as the shortest text that reads back as its float64 value
(``orjson`` over the float64 array), the same values ``json.dumps(v.tolist())`` writes; only the
spelling of some numbers differs (``1e-06`` there, ``1e-6`` here; ``9.5e-05`` there, ``0.000095``
here). Non-finite values are refused
(ValueError, so a 500) as ``json.dumps(..., allow_nan=False)`` refused them. Base64: the
little-endian float32 bytes of each row.

Invariants: the event loop never runs a per-value loop of a big answer: ``render`` builds any
answer heavier than ``INLINE_VALUES`` in a worker thread. A single C call holds the GIL for its
whole length, so arrays are encoded in slices of about ``SLICE_VALUES`` values: the loop, asking
for the GIL, waits at most one slice (~1 ms) at a time, never the whole answer; and a big body is
sent in ``STREAM_BYTES`` pieces, never copied whole on the loop.
"""
from __future__ import annotations

import asyncio
import base64
import math
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Sequence, TypeVar

import numpy as np
import orjson
from starlette.responses import Response, StreamingResponse

INLINE_VALUES = 8192  # answers up to this many values are rendered on the loop (a thread hop costs more)
SLICE_VALUES = 32768  # values per encoder call: about a millisecond or two of GIL held at once
STREAM_BYTES = 256 * 1024  # bodies above this go out in pieces of this size
_OPTS = orjson.OPT_SERIALIZE_NUMPY
RECORD_VALUES = 16  # rendering weight of one answer record (a dict, maybe a text) in float values
T = TypeVar("T")


def dumps(obj: Any) -> bytes:
    """JSON bytes of plain Python values (numpy float64 arrays allowed inside)."""
    return orjson.dumps(obj, option=_OPTS)


def _slices(x: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, float64 rows) of ``x`` [R, ...] in slices of ~SLICE_VALUES values, each checked finite."""
    per_row = max(1, math.prod(x.shape[1:]))  # NOTE: not np.prod, an array and a reduce per call
    step = max(1, SLICE_VALUES // per_row)
    for a in range(0, x.shape[0], step):
        part = np.ascontiguousarray(x[a:a + step], dtype=np.float64)  # [r, ...]
        # NOTE: the ufunc's reduce, not ndarray.all (a Python wrapper around the same reduce)
        if not np.logical_and.reduce(np.isfinite(part), axis=None):
            raise ValueError("an answer holds a non-finite float (NaN or infinity); JSON cannot carry it")
        yield a, part


def float_array(x: np.ndarray) -> bytes:
    """``x`` ([R, ...] float) as a JSON array, values as ``json.dumps(x.tolist())`` reads them."""
    # NOTE: [1:-1] cuts the outer brackets of each slice, so slices join with commas.
    return join_items(dumps(part)[1:-1] for _, part in _slices(x) if len(part))


def float_records(x: np.ndarray, make: Callable[[int, np.ndarray], dict]) -> bytes:
    """A JSON array of one object per row of ``x`` [R, E]: ``make(row index, float64 row)``."""
    slices = _slices(x)
    if x.size <= SLICE_VALUES:  # one slice (a query's answer): its array is the whole array
        return dumps([make(j, row) for _, part in slices for j, row in enumerate(part)])
    return join_items(dumps([make(a + j, row) for j, row in enumerate(part)])[1:-1] for a, part in slices)


def ragged_array(parts: Sequence[np.ndarray]) -> bytes:
    """A JSON array of float arrays of different shapes (per-token states: [L, E] each)."""
    return b"[" + b",".join(float_array(p) for p in parts) + b"]"


def base64_rows(x: np.ndarray) -> list[str]:
    """Each row of ``x`` [R, E] as base64 of its little-endian float32 bytes."""
    le = np.ascontiguousarray(x, dtype="<f4")  # [R, E]
    return [base64.b64encode(row.tobytes()).decode("ascii") for row in le]


def join_items(items: Iterable[bytes]) -> bytes:
    """A JSON array of already-encoded items."""
    return b"[" + b",".join(items) + b"]"


def with_array(envelope: dict, key: str, array: bytes) -> bytes:
    """``envelope`` as JSON with ``array`` (encoded JSON) as the value of ``key`` (copied once)."""
    return dumps({**envelope, key: orjson.Fragment(array)})


async def render(build: Callable[[], T], *, weight: int) -> T:
    """``build()``; in a worker thread when the answer holds more than INLINE_VALUES values."""
    if weight <= INLINE_VALUES:
        return build()
    return await asyncio.to_thread(build)


class JsonBytes(Response):
    """A 200 JSON answer of bytes already encoded: starlette's Response, its header list built in
    one pass (the headers given, then Content-Length and Content-Type, as ``init_headers`` orders
    them; headers that name either of those two take starlette's own path)."""

    media_type = "application/json"

    def __init__(self, content: bytes, headers: dict[str, str] | None = None) -> None:
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()] if headers else []
        if any(k in _SIZED for k, _ in raw):
            super().__init__(content, headers=headers)
            return
        self.status_code, self.background, self.body = 200, None, content
        raw.append((b"content-length", b"%d" % len(content)))
        raw.append((b"content-type", b"application/json"))
        self.raw_headers = raw


_SIZED = (b"content-length", b"content-type")


def json_answer(content: bytes, headers: dict[str, str] | None = None) -> Response:
    """The answer; a big body goes out in STREAM_BYTES pieces (with its Content-Length), so the
    loop never copies it whole (the HTTP layer would, once per framing step)."""
    if len(content) <= STREAM_BYTES:
        return JsonBytes(content, headers)
    view = memoryview(content)

    async def pieces() -> AsyncIterator[bytes]:
        for at in range(0, len(view), STREAM_BYTES):
            yield view[at:at + STREAM_BYTES]  # type: ignore[misc]  # a memoryview: no copy here

    sized = {**(headers or {}), "content-length": str(len(content))}
    return StreamingResponse(pieces(), media_type="application/json", headers=sized)
