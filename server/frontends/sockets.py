"""The API port bound once per front end: SO_REUSEPORT listeners the kernel balances across.

Each front end gets a listening socket of its own on --hostname/--port, so Linux spreads new
connections over the front ends by a hash of the client's address and port (no shared accept
queue, no thundering herd); a front end's queue is its own. The engine binds them all before it
starts any front end, so a taken port or a bad address fails the start once, and port 0 binds
the first on a free port and the others on the same one. Each front end listens (its event loop
does, when its server starts), so the kernel sends a front end connections only once it serves:
none wait in the queue of one still starting. --uds-path is one shared socket, listening at once.
"""
from __future__ import annotations

import contextlib
import os
import socket
import stat


def bind_api(*, hostname: str, port: int, count: int, uds_path: str | None) -> tuple[list[socket.socket],
                                                                                   socket.socket | None]:
    """``count`` TCP sockets bound to one port (not listening yet), and the unix socket when asked."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("--api-server-count above 1 needs SO_REUSEPORT (Linux, BSD, macOS)")
    family = socket.AF_INET6 if ":" in hostname else socket.AF_INET
    tcp: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            tcp.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((hostname, port))
            port = sock.getsockname()[1]  # port 0: the others join the one the first got
        return tcp, _bind_uds(uds_path) if uds_path else None
    except BaseException:
        for sock in tcp:
            sock.close()
        raise


def _bind_uds(path: str) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise FileExistsError(f"--uds-path {path} exists and is not a socket")
        os.unlink(path)  # a stale socket from a previous run
    uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    uds.bind(path)
    uds.listen(2048)
    return uds


def bind_side(*, hostname: str, port: int) -> socket.socket:
    """The --prometheus-port listener (the engine serves it)."""
    family = socket.AF_INET6 if ":" in hostname else socket.AF_INET
    return socket.create_server((hostname, port), family=family, backlog=128)
