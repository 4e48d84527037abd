"""The engine <-> front-end wire: length-prefixed pickles over a private socket pair.

Both ends are processes of one server (the engine makes the pair and hands one end to the child
it starts), so pickle is safe here; nothing a client sends is unpickled, only what the front end
built from it. Each end is a ``Channel`` on its event loop: the frames that arrive are parsed and
handed on in the same callback (no task, no await per message), and the frames sent in one
loop iteration leave in one write (at any concurrency above one, several submits or results
share a send). Token ids travel as the lists they are (a pickle of small ints is cheaper to
build and read than an array plus offsets), pooled outputs as one flat buffer plus dtype and
shape (``pack_outputs``), never one pickled array per item.

Messages are tuples whose first element names them:
- front end -> engine: ``("submit", sid, items, request_id, all_tokens, namespace)``,
  ``("cancel", sid)``, ``("scrape", sid)``, ``("ping", sid)``, ``("collected", cid, families)``;
- engine -> front end: ``("hello", dict)`` (first), ``("result", sid, packed_outputs, queue_s,
  inference_s, compute_tokens)``, ``("error", sid, "batch" | "dead", message)``,
  ``("scraped", sid, families)``, ``("pong", sid, healthy)``, ``("collect", cid)``, ``("startup", seconds)``, ``("dead", reason)``.
"""
from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from typing import Any, Callable, cast

import numpy as np

_HEAD = struct.Struct("!Q")  # payload bytes
_HEAD_SIZE = _HEAD.size


def frame(message: Any) -> bytes:
    """``message`` as one frame: 8-byte length, then its pickle."""
    payload = pickle.dumps(message, protocol=5)
    return _HEAD.pack(len(payload)) + payload


class Channel(asyncio.Protocol):
    """One end of the socket pair on the running loop.

    ``on_message(msg)`` is called for each message in arrival order, from ``data_received``;
    ``on_lost(exc)`` once when the connection ends (the peer's end of file, an error, or
    ``close``). ``send`` queues a frame and flushes every frame queued in this loop iteration
    with one ``transport.write`` (``loop.call_soon``), so messages keep their order and a burst
    costs one syscall. Nothing is sent after ``close``."""

    def __init__(self, on_message: Callable[[Any], None], on_lost: Callable[[BaseException | None], None]) -> None:
        self.on_message = on_message
        self.on_lost = on_lost
        self.closed = False
        self._transport: asyncio.Transport | None = None
        self._inbox = bytearray()  # a frame's bytes received so far (empty between frames)
        self._need = 0  # the bytes the inbox needs to hold its first frame whole
        self._outbox: list[bytes] = []
        self._flush_pending = False
        self.loop = asyncio.get_running_loop()  # made on the loop that serves it

    @classmethod
    async def open(cls, sock: socket.socket, on_message: Callable[[Any], None],
                   on_lost: Callable[[BaseException | None], None]) -> Channel:
        _, channel = await asyncio.get_running_loop().create_connection(lambda: cls(on_message, on_lost), sock=sock)
        return channel

    # -- sending --------------------------------------------------------------------------------
    def send(self, message: Any) -> None:
        if self.closed:
            return
        self._outbox.append(frame(message))
        if not self._flush_pending:
            self._flush_pending = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        if self._transport is None:
            return  # not connected yet: connection_made sends what waits
        out, self._outbox = self._outbox, []
        if out and not self.closed:
            self._transport.write(out[0] if len(out) == 1 else b"".join(out))

    def close(self) -> None:
        """Send what is queued, then close (``on_lost`` follows)."""
        if self.closed:
            return
        self._flush()
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    # -- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # a uvloop transport is no asyncio.Transport subclass
        self._flush()

    def data_received(self, data: bytes) -> None:
        if self._inbox:  # the rest of a frame begun earlier: wait until it is whole, then copy once
            self._inbox += data
            if len(self._inbox) < self._need:
                return
            data = bytes(self._inbox)
            self._inbox.clear()
        n, pos = len(data), 0
        while n - pos >= _HEAD_SIZE:
            end = pos + _HEAD_SIZE + _HEAD.unpack_from(data, pos)[0]
            if end > n:
                break
            message = pickle.loads(data[pos + _HEAD_SIZE:end] if pos or end < n else data[_HEAD_SIZE:])
            pos = end
            self.on_message(message)
        if pos < n:
            self._inbox += data[pos:] if pos else data
            self._need = (_HEAD_SIZE + _HEAD.unpack_from(self._inbox)[0] if len(self._inbox) >= _HEAD_SIZE
                          else _HEAD_SIZE)

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._outbox.clear()
        self.on_lost(exc)


def send_sync(sock: socket.socket, message: Any) -> None:
    sock.sendall(frame(message))


def recv_sync(sock: socket.socket) -> Any:
    """One message from a blocking socket (the hello, before the front end's event loop runs)."""
    head = _recv_exactly(sock, _HEAD.size)
    return pickle.loads(_recv_exactly(sock, _HEAD.unpack(head)[0]))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the engine closed the connection")
        got += k
    return bytes(buf)


def pack_outputs(outputs: list) -> tuple:
    """A submit's outputs for the wire: same-shape arrays (pooled vectors, or one item's token
    states) as ``("a", dtype, shape, count, bytes)``, their rows concatenated; anything else (scores,
    token states of several lengths) as ``("l", outputs)``."""
    first = outputs[0] if outputs else None
    if isinstance(first, np.ndarray) and all(
            isinstance(o, np.ndarray) and o.shape == first.shape and o.dtype == first.dtype for o in outputs):
        raw = first.tobytes() if len(outputs) == 1 else b"".join([o.tobytes() for o in outputs])
        return ("a", first.dtype.str, first.shape, len(outputs), raw)
    return ("l", outputs)


def unpack_outputs(packed: tuple) -> list:
    """The inverse of ``pack_outputs``: one writable array per item (rows of one buffer)."""
    if packed[0] == "l":
        return packed[1]
    _, dtype, shape, count, raw = packed
    rows = np.frombuffer(bytearray(raw), dtype=dtype).reshape(count, *shape)  # [B, *shape]
    return list(rows)
