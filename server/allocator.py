"""The images' memory settings, applied by the server itself so a plain ``pip install`` gets them.

The Docker images set four variables (Dockerfile; docs/operations.md, "Memory (RSS) on the CPU"):
jemalloc preloaded with ``MALLOC_CONF=oversize_threshold:0,background_thread:true``, and oneDNN's
two per-shape primitive caches capped at 64 entries. Without them a CPU server's RSS climbs under
churning inputs (glibc's malloc keeps what the churn fragments; the caches keep every shape).
``apply_image_settings`` runs first in ``radixserve``'s main, before torch is imported:
- the cache capacities: set in the environment where unset (torch and oneDNN read them at load);
- jemalloc: a preload only takes effect at exec, so where the library is installed and not yet
  mapped, the process re-executes itself once with ``LD_PRELOAD`` and ``MALLOC_CONF`` set;
- else on glibc: ``mallopt(M_ARENA_MAX, 2)`` (unless ``MALLOC_ARENA_MAX`` is set): one 64 MiB
  arena reservation per thread otherwise inflates the address space that a memory limit such as
  ``ulimit -v`` counts.
Anything the user set wins: an ``LD_PRELOAD`` in the environment (even empty) means no re-exec,
and ``RADIXSERVE_ALLOCATOR=system`` turns all of this off.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger("radixserve.server")

OFF_VAR = "RADIXSERVE_ALLOCATOR"  # "system": leave the allocator and caches as they are
MARK_VAR = "RADIXSERVE_REEXECED"  # set on the re-executed process: never twice
JEMALLOC = "libjemalloc.so.2"
IMAGE_ENV = {
    "LRU_CACHE_CAPACITY": "64",
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64",
}
JEMALLOC_CONF = "oversize_threshold:0,background_thread:true"
M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)


def jemalloc_mapped() -> bool:
    """Is jemalloc in this process's memory map (preloaded or linked)?"""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return any("jemalloc" in line for line in maps)
    except OSError:
        return False


def reexec_env(environ: dict[str, str]) -> dict[str, str] | None:
    """The environment to re-execute with (jemalloc preloaded), or None to stay as we are."""
    if environ.get(OFF_VAR) == "system" or MARK_VAR in environ or "LD_PRELOAD" in environ:
        return None
    if not sys.platform.startswith("linux") or ctypes.util.find_library("jemalloc") != JEMALLOC:
        return None
    if jemalloc_mapped():
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = JEMALLOC
    env.setdefault("MALLOC_CONF", JEMALLOC_CONF)
    env[MARK_VAR] = "1"
    return env


def limit_glibc_arenas(environ: dict[str, str]) -> bool:
    """mallopt(M_ARENA_MAX, 2) on glibc unless the user chose; True when applied."""
    if "MALLOC_ARENA_MAX" in environ or jemalloc_mapped():
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    return bool(mallopt(ctypes.c_int(M_ARENA_MAX), ctypes.c_int(2)))


def is_process_entry() -> bool:
    """Is this process the command line itself (its arguments are ``sys.argv``'s), so that
    re-executing ``sys.orig_argv`` runs the same command? Not under a test runner."""
    orig = getattr(sys, "orig_argv", None)
    if not orig or "pytest" in sys.modules or len(sys.argv) > len(orig):
        return False
    return sys.argv[1:] == orig[len(orig) - len(sys.argv) + 1:]


def apply_image_settings(*, reexec: bool = True) -> None:
    """Apply the images' settings to this process (see the module docstring). ``reexec``: allowed
    to replace the process (only the real command line, never a caller that embeds ``main``)."""
    environ = os.environ
    if environ.get(OFF_VAR) == "system":
        return
    for name, value in IMAGE_ENV.items():
        environ.setdefault(name, value)
    if "torch" in sys.modules:
        log.warning("torch was imported before the cache capacities were set: they may not apply")
    env = reexec_env(dict(environ)) if reexec and is_process_entry() else None
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execve(sys.executable, list(sys.orig_argv), env)  # does not return
        except OSError as exc:
            log.warning("could not re-execute with jemalloc preloaded: %s", exc)
    if limit_glibc_arenas(dict(environ)):
        log.info("glibc malloc: at most 2 arenas (set MALLOC_ARENA_MAX to choose)")
    elif jemalloc_mapped():
        log.info("malloc: jemalloc (%s)", environ.get("MALLOC_CONF", "default settings"))


_TRIM: list = []  # [libc.malloc_trim] once looked up; [None] where there is none (jemalloc, musl, macOS)


def release_free_memory() -> bool:
    """Give the pages malloc holds free back to the system (glibc ``malloc_trim(0)``); True when
    some were. After a large request glibc keeps its freed heap (RSS stays at the request's peak);
    jemalloc returns it on its own (its background thread purges dirty pages after
    ``dirty_decay_ms``, 10 s by default), so there this does nothing."""
    if not _TRIM:
        trim = None
        if not jemalloc_mapped():
            try:
                trim = ctypes.CDLL(None).malloc_trim
                trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
            except (OSError, AttributeError):
                trim = None
        _TRIM.append(trim)
    return bool(_TRIM[0](0)) if _TRIM[0] is not None else False
