"""The output file: written per chunk (write, flush, fsync), and resumed from an earlier run's lines.

A chunk is one window's answer lines, joined and written with one ``write``, then flushed and
fsynced: when the call returns the chunk is on disk, so a killed job loses at most the chunk in
flight. A kill during that write can leave a torn last line; ``scan`` finds it (no final newline,
or not JSON), cuts the file back to the last whole line, and reports what the whole lines cover:
how many lines answered each ``custom_id`` (a restarted job skips as many occurrences of it in
the input), the input line numbers of error lines without a custom_id, and how many lines failed.

Invariant: only the last line of an output file may be torn; a bad line anywhere else means the
file is not this job's output, and resuming is refused rather than appending to it.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import IO

import orjson


class NotResumable(ValueError):
    """The output file holds something other than whole answer lines of a batch job."""


@dataclass
class Resume:
    """What an earlier run's output already answers."""

    ids: Counter = field(default_factory=Counter)  # custom_id -> lines written for it
    lines: set[int] = field(default_factory=set)  # input line numbers of written lines without custom_id
    written: int = 0
    failed: int = 0
    torn_bytes: int = 0  # bytes of a torn last line that were cut off


def scan(path: str) -> Resume:
    """Read ``path`` (missing: nothing done); cut a torn last line off the file in place."""
    out = Resume()
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return out
    with f:
        good = 0  # bytes of whole, valid lines so far
        number = 0
        while True:
            raw = f.readline()
            if not raw:
                break
            number += 1
            record = _record(raw) if raw.endswith(b"\n") else None
            if record is None:
                if f.read(1):  # not the last line: this file is not ours to append to
                    raise NotResumable(f"{path}: line {number} is not an answer line of a batch job; "
                                       "refusing to resume into it (give another --output-file)")
                out.torn_bytes = len(raw)
                break
            good += len(raw)
            _note(out, record)
        if out.torn_bytes:
            f.truncate(good)
            f.flush()
            os.fsync(f.fileno())
    return out


def _record(raw: bytes) -> dict | None:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or "custom_id" not in obj or "response" not in obj:
        return None
    return obj


def _note(out: Resume, record: dict) -> None:
    out.written += 1
    error = record.get("error")
    if error is not None:
        out.failed += 1
    cid = record.get("custom_id")
    if isinstance(cid, str):
        out.ids[cid] += 1
    elif isinstance(error, dict) and isinstance(error.get("line"), int):
        out.lines.add(error["line"])


class ChunkWriter:
    """Appends chunks of answer lines to a file (or a stream), each durable once written."""

    def __init__(self, stream: IO[bytes], *, sync: bool) -> None:
        self.stream = stream
        self.sync = sync  # fsync after each chunk (a regular file; a pipe cannot)

    @classmethod
    def open(cls, path: str) -> "ChunkWriter":
        return cls(open(path, "ab"), sync=True)

    def write_chunk(self, lines: list[bytes]) -> None:
        if not lines:
            return
        self.stream.write(b"".join(lines))
        self.stream.flush()
        if self.sync:
            os.fsync(self.stream.fileno())

    def close(self) -> None:
        self.stream.close()
