"""The answer encoder (server/service/encoding.py) against the encoder it replaced.

The reference is what the routes did before: ``json.dumps(x.tolist())`` of the float32 array
(each value the shortest text of its float64 value). Every parsed value must be the same float64
bit for bit (negative zero included), on random vectors salted with edge values, across slice
boundaries, for every shape a route writes.
"""
from __future__ import annotations

import asyncio
import base64
import json
import struct
import threading

import numpy as np
import orjson
import pytest

from server.service import encoding

EDGES = np.array([
    0.0, -0.0, 1.0, -1.0, np.finfo(np.float32).max, -np.finfo(np.float32).max, np.finfo(np.float32).tiny,
    np.finfo(np.float32).smallest_subnormal, -np.finfo(np.float32).smallest_subnormal, 1e-40, 3e-39,
    1e-7, 1e-5, 1e-4, 0.1, 1 / 3, 123456.7, 1e16, 1e17, 1e21, 1e22, -2.5e-8, 65504.0, 16777217.0,
], dtype=np.float32)


def bits(values) -> list[int]:
    """Each parsed value as its float64 bit pattern (so -0.0 != 0.0 and NaN payloads count)."""
    return [struct.unpack("<q", struct.pack("<d", float(v)))[0] for v in values]


def flat(obj) -> list:
    if isinstance(obj, list):
        return [v for o in obj for v in flat(o)]
    return [obj]


def reference(x: np.ndarray) -> bytes:
    return json.dumps(x.tolist(), separators=(",", ":")).encode()


def vectors(rng, rows: int, dim: int) -> np.ndarray:
    x = (rng.standard_normal((rows, dim)) * 10.0 ** rng.integers(-30, 30, size=(rows, 1))).astype(np.float32)
    where = rng.integers(0, x.size, size=min(x.size, 4 * len(EDGES)))
    x.reshape(-1)[where] = np.resize(EDGES, len(where))
    x[0, : min(dim, len(EDGES))] = EDGES[:dim]
    return x


@pytest.mark.parametrize("rows,dim", [(1, 24), (3, 1024), (70, 1000), (1, 40000)])
def test_float_arrays_parse_to_the_old_encoders_values_bit_for_bit(rows, dim):
    rng = np.random.default_rng(rows * 7 + dim)
    x = vectors(rng, rows, dim)
    ours = encoding.float_array(x)
    assert bits(flat(json.loads(ours))) == bits(flat(json.loads(reference(x))))
    assert np.array(json.loads(ours)).shape == (rows, dim)
    # NOTE: the text may differ (1e-06 there, 1e-6 here; 9.9e-05 there, 0.000099 here), never the values.


def test_slices_join_into_one_array_across_row_boundaries(monkeypatch):
    monkeypatch.setattr(encoding, "SLICE_VALUES", 7)  # rows of 3 values: 2 rows per slice, a ragged tail
    x = vectors(np.random.default_rng(1), 9, 3)
    assert bits(flat(json.loads(encoding.float_array(x)))) == bits(flat(json.loads(reference(x))))
    scores = x[:, 0].copy()  # [R] scalars, as /similarity and scores are
    assert bits(json.loads(encoding.float_array(scores))) == bits(json.loads(reference(scores)))


def test_records_and_envelope_equal_the_old_openai_body():
    x = vectors(np.random.default_rng(2), 5, 16)
    data = encoding.float_records(x, lambda i, e: {"object": "embedding", "embedding": e, "index": i})
    body = json.loads(encoding.with_array({"object": "list", "data": None, "model": 'a"b', "usage": {"n": 3}},
                                          "data", data))
    old = {"object": "list", "model": 'a"b', "usage": {"n": 3},
           "data": [{"object": "embedding", "embedding": e, "index": i} for i, e in enumerate(x.tolist())]}
    assert list(body) == ["object", "data", "model", "usage"]
    assert body["data"] == old["data"] and body["model"] == old["model"]
    assert bits(flat([d["embedding"] for d in body["data"]])) == bits(flat(x.tolist()))


def test_ragged_per_token_states():
    rng = np.random.default_rng(3)
    parts = [vectors(rng, n, 8) for n in (1, 5, 2)]
    got = json.loads(encoding.ragged_array(parts))
    assert [np.array(g).shape for g in got] == [(1, 8), (5, 8), (2, 8)]
    assert bits(flat(got)) == bits(flat([p.tolist() for p in parts]))


def test_base64_rows_are_the_little_endian_float32_bytes():
    x = vectors(np.random.default_rng(4), 3, 10)
    for row, text in zip(x, encoding.base64_rows(x)):
        assert np.array_equal(np.frombuffer(base64.b64decode(text), "<f4"), row, equal_nan=True)
    assert encoding.base64_rows(x) == [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in x]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, "both infinities"])
def test_non_finite_values_are_refused_as_before(bad, dtype):
    x = np.ones((2, 4), dtype)
    if bad == "both infinities":
        x[0, 1], x[1, 2] = np.inf, -np.inf
    else:
        x[1, 2] = bad
    with pytest.raises(ValueError):
        json.dumps(x.tolist(), allow_nan=False)  # the old encoder refused it too
    with pytest.raises(ValueError, match="non-finite"):
        encoding.float_array(x)
    with pytest.raises(ValueError, match="non-finite"):
        encoding.float_records(x, lambda i, row: {"index": i, "embedding": row})


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_largest_finite_values_are_not_refused(dtype):
    big = np.finfo(dtype).max
    x = np.full((3, 5), big, dtype)
    x[2, 4] = -big
    assert json.loads(encoding.float_array(x)) == x.astype(np.float64).tolist()
    records = json.loads(encoding.float_records(x, lambda i, row: {"index": i, "embedding": row}))
    assert [r["embedding"] for r in records] == x.astype(np.float64).tolist()


def test_plain_values_match_the_old_dumps():
    values = [{"index": 2, "score": 0.1, "text": "héllo \u2028 \"q\""}, {"index": 0, "score": 1e-06}]
    assert json.loads(encoding.dumps(values)) == json.loads(json.dumps(values, ensure_ascii=False))
    assert orjson.loads(encoding.dumps(["ü"])) == ["ü"]


def test_render_is_inline_when_small_and_in_a_thread_when_big():
    where: list[str] = []

    def build() -> bytes:
        where.append(threading.current_thread().name)
        return b"[]"

    async def go():
        await encoding.render(build, weight=encoding.INLINE_VALUES)
        await encoding.render(build, weight=encoding.INLINE_VALUES + 1)

    asyncio.run(go())
    assert where[0] == "MainThread" and where[1] != "MainThread"


def test_a_big_answer_goes_out_in_pieces_with_its_length():
    content = encoding.float_array(vectors(np.random.default_rng(5), 64, 1024))
    assert len(content) > 2 * encoding.STREAM_BYTES
    response = encoding.json_answer(content, {"x-total-time": "3"})
    sent: list[dict] = []

    async def receive():
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(response({"type": "http", "asgi": {"spec_version": "2.4"}, "method": "GET", "path": "/"},
                         receive, send))
    headers = dict(sent[0]["headers"])
    assert headers[b"content-length"] == str(len(content)).encode() and headers[b"x-total-time"] == b"3"
    assert headers[b"content-type"] == b"application/json"
    bodies = [bytes(m["body"]) for m in sent[1:]]
    assert b"".join(bodies) == content
    assert max(map(len, bodies)) == encoding.STREAM_BYTES
    small = encoding.json_answer(b"[1.0]")
    assert small.body == b"[1.0]" and small.media_type == "application/json"


@pytest.mark.parametrize("headers", [None, {}, {"X-Queue-Time": "1.000", "x-compute-tokens": "22"},
                                     {"content-type": "application/x-ndjson"}, {"Content-Length": "7"}])
def test_json_bytes_is_starlettes_response(headers):
    """``JsonBytes`` builds the header list starlette's ``Response`` would, in the same order."""
    from starlette.responses import Response

    from server.service.encoding import JsonBytes

    ours = JsonBytes(b'{"a":1}', headers)
    theirs = Response(b'{"a":1}', media_type="application/json", headers=headers)
    assert (ours.status_code, ours.body, ours.raw_headers, ours.background) == \
        (theirs.status_code, theirs.body, theirs.raw_headers, theirs.background)
