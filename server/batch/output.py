"""The output file: written per chunk (write, flush, fsync), and resumed from an earlier run's lines.

A chunk is one window's answer lines, joined and written with one ``write``, then flushed and
fsynced: when the call returns the chunk is on disk, so a killed job loses at most the chunk in
flight. A kill during that write can leave a torn last line; ``scan`` finds it (no final newline,
or not JSON), cuts the file back to the last whole line, and reports what the whole lines cover:
how many lines answered each ``custom_id`` (a restarted job skips as many occurrences of it in
the input), the input line numbers of error lines without a custom_id, and how many lines failed.

Invariant: only the last line of an output file may be torn; a bad line anywhere else means the
file is not this job's output, and resuming is refused rather than appending to it. The output is
a regular file (or stdout, written as a stream): ``check_output`` refuses anything else before the
model loads, and ``scan`` reads at most the bytes the file held when it began, so a device that
reads forever (/dev/full, /dev/zero) can never hold it.
"""
from __future__ import annotations

import os
import stat
from collections import Counter
from dataclasses import dataclass, field
from typing import IO

import orjson


class Unrunnable(Exception):
    """The job cannot run, or cannot go on (a file it cannot read or write): one line, exit 2."""


class NotResumable(Unrunnable):
    """The output file holds something other than whole answer lines of a batch job."""


DEVICE_DIRS = ("/dev/", "/proc/", "/sys/")  # /dev/stdout, /dev/full, /proc/self/fd/1: streams, not files


def check_output(path: str) -> None:
    """Refuse an output that is not a regular file this process can create or append to."""
    full = os.path.abspath(path)
    if full.startswith(DEVICE_DIRS):
        raise Unrunnable(f"{path}: the output must be a regular file, not a device or stream (-o - writes to stdout)")
    try:
        st = os.stat(full)
    except FileNotFoundError:
        parent = os.path.dirname(full)
        if not os.path.isdir(parent):
            raise Unrunnable(f"{path}: no such directory: {parent}") from None
        if not os.access(parent, os.W_OK):
            raise Unrunnable(f"{path}: cannot create a file in {parent} (read-only file system or no permission)") from None
        return
    except OSError as exc:
        raise Unrunnable(f"{path}: {exc.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise Unrunnable(f"{path}: is a directory; give a file name")
    if not stat.S_ISREG(st.st_mode):
        raise Unrunnable(f"{path}: the output must be a regular file, not a device, pipe or socket (-o - writes to stdout)")
    if not os.access(full, os.W_OK):
        raise Unrunnable(f"{path}: not writable (read-only file system or no permission)")


@dataclass
class Resume:
    """What an earlier run's output already answers."""

    ids: Counter = field(default_factory=Counter)  # custom_id -> lines written for it
    lines: set[int] = field(default_factory=set)  # input line numbers of written lines without custom_id
    written: int = 0
    failed: int = 0
    torn_bytes: int = 0  # bytes of a torn last line that were cut off


def scan(path: str) -> Resume:
    """Read ``path`` (missing: nothing done); cut a torn last line off the file in place.

    Reads at most the file's size when opened (a regular file: ``check_output`` came first; a
    file that something else keeps growing is read up to where it ended then)."""
    out = Resume()
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return out
    except OSError as exc:
        raise Unrunnable(f"{path}: cannot open the output to resume it: {exc.strerror}") from None
    with f:
        try:
            _scan(path, f, out)
        except OSError as exc:
            raise Unrunnable(f"{path}: reading the output to resume it failed: {exc.strerror or exc}") from None
    return out


def _scan(path: str, f: IO[bytes], out: Resume) -> None:
    st = os.fstat(f.fileno())
    if not stat.S_ISREG(st.st_mode):
        raise Unrunnable(f"{path}: the output must be a regular file, not a device, pipe or socket")
    size = st.st_size
    good = 0  # bytes of whole, valid lines so far
    number = 0
    while good < size:
        raw = f.readline(size - good)
        if not raw:
            break
        number += 1
        record = _record(raw) if raw.endswith(b"\n") else None
        if record is None:
            if good + len(raw) < size:  # not the last line: this file is not ours to append to
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

    def __init__(self, stream: IO[bytes], *, sync: bool, name: str = "stdout") -> None:
        self.stream = stream
        self.sync = sync  # fsync after each chunk (a regular file; a pipe cannot)
        self.name = name  # what an error message calls it
        self.failed = False  # a write failed (closing then drops what the buffer still holds)

    @classmethod
    def open(cls, path: str) -> "ChunkWriter":
        try:
            stream = open(path, "ab")
        except OSError as exc:
            raise Unrunnable(f"{path}: cannot open the output: {exc.strerror}") from None
        return cls(stream, sync=True, name=path)

    def write_chunk(self, lines: list[bytes]) -> None:
        if not lines:
            return
        try:
            self.stream.write(b"".join(lines))
            self.stream.flush()
            if self.sync:
                os.fsync(self.stream.fileno())
        except OSError as exc:  # a full disk, a file grown past its limit, a closed pipe
            self.failed = True
            raise Unrunnable(f"{self.name}: writing the output failed: {exc.strerror or exc}") from None

    def close(self) -> None:
        """Close; after a failed write the unwritten rest is dropped (the failure was reported)."""
        try:
            self.stream.close()
        except OSError as exc:
            if not self.failed:
                raise Unrunnable(f"{self.name}: writing the output failed: {exc.strerror or exc}") from None
