"""A plain install gets the images' memory settings: a real ``radixserve`` process re-executes
itself with jemalloc preloaded and the oneDNN caches capped, or (no jemalloc) limits glibc's arenas."""
from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

from server import allocator

PROBE = ("import os, sys; from server import allocator; allocator.apply_image_settings(); "
         "print(allocator.jemalloc_mapped(), os.environ.get('LRU_CACHE_CAPACITY'), "
         "os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'), os.environ.get('MALLOC_CONF'))")


def _run(env_extra: dict, *args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF", allocator.MARK_VAR,
                                                            "LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_plain_process_gets_the_image_settings():
    jemalloc, lru, onednn, conf = _run({}, "--some-arg")
    assert (lru, onednn) == ("64", "64")
    if ctypes.util.find_library("jemalloc") == allocator.JEMALLOC:
        assert jemalloc == "True" and conf == allocator.JEMALLOC_CONF
    else:
        assert jemalloc == "False"


def test_user_choices_win():
    jemalloc, lru, _, _ = _run({"LD_PRELOAD": "", "LRU_CACHE_CAPACITY": "256"})
    assert jemalloc == "False" and lru == "256"  # an explicit (empty) LD_PRELOAD: no re-exec
    jemalloc, lru, _, _ = _run({allocator.OFF_VAR: "system"})
    assert jemalloc == "False" and lru == "None"


def test_never_reexecutes_an_embedding_caller():
    assert not allocator.is_process_entry()  # under pytest: main(argv) or a patched sys.argv must not exec
