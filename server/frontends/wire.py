"""The engine <-> front-end wire: length-prefixed pickles over a private socket pair.

Both ends are processes of one server (the engine makes the pair and hands one end to the child
it starts), so pickle is safe here; nothing a client sends is unpickled, only what the front end
built from it. Token ids travel as one int32 array plus offsets, outputs as numpy arrays
(pickle protocol 5 copies their buffers once), never as JSON.

Messages are tuples whose first element names them:
- front end -> engine: ``("submit", sid, flat, offsets, request_id, all_tokens, namespace)``,
  ``("cancel", sid)``, ``("scrape", sid)``, ``("collected", cid, families)``;
- engine -> front end: ``("hello", dict)`` (first), ``("result", sid, outputs, queue_s,
  inference_s, compute_tokens)``, ``("error", sid, "batch" | "dead", message)``,
  ``("scraped", sid, families)``, ``("collect", cid)``, ``("startup", seconds)``, ``("dead", reason)``.
"""
from __future__ import annotations

import asyncio
import itertools
import pickle
import socket
import struct
from typing import Any, Sequence

import numpy as np

_HEAD = struct.Struct("!Q")  # payload bytes


def frame(message: Any) -> bytes:
    """``message`` as one frame: 8-byte length, then its pickle."""
    payload = pickle.dumps(message, protocol=5)
    return _HEAD.pack(len(payload)) + payload


async def read(reader: asyncio.StreamReader) -> Any:
    """The next message (raises ``asyncio.IncompleteReadError`` at the end of the stream)."""
    head = await reader.readexactly(_HEAD.size)
    return pickle.loads(await reader.readexactly(_HEAD.unpack(head)[0]))


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


def pack_items(items: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token id lists -> (ids int32 [N], offsets int64 [B+1])."""
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum([len(i) for i in items], out=offsets[1:])
    flat = np.fromiter(itertools.chain.from_iterable(items), dtype=np.int32, count=int(offsets[-1]))
    return flat, offsets


def unpack_items(flat: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    """The inverse of ``pack_items``: fresh lists, handed to the scheduler uncopied."""
    ids, cuts = flat.tolist(), offsets.tolist()
    return [ids[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
