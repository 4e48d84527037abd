"""The measurement cache keys by the timed modules' names as well as their source.

A module moved without a change to its source (models/attention_tiles.py became
models/attention/tiles.py byte for byte) hashes the same: keyed by the source alone, the figure
stored under the old name would be read under the new one. Keyed by the names too, it is a miss:
the kernel is measured again once, and stored under the new name.
"""
from __future__ import annotations

import json

import pytest
import torch

from models import measure_cache

SOURCE = "def kernel(x):\n    return x\n"


@pytest.fixture
def moved(tmp_path, monkeypatch):
    """The same source under an old and a new module name, and an empty measurement cache."""
    monkeypatch.setenv(measure_cache.ENV, str(tmp_path / "measurements.json"))
    (tmp_path / "kernels_before_the_move.py").write_text(SOURCE)
    (tmp_path / "kernels_after_the_move.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "kernels_before_the_move", "kernels_after_the_move"


def _key(module: str) -> str:
    return measure_cache.key("k", modules=(module,), dtype=torch.float32, rows=4)


def test_an_entry_under_a_moved_modules_old_name_is_not_read(moved):
    old, new = moved
    measure_cache.store(_key(old), 2.5)
    assert measure_cache.lookup(_key(old)) == 2.5  # the old process's own figure
    assert json.loads(_key(old))["code"] == json.loads(_key(new))["code"]  # the same source
    assert _key(new) != _key(old) and measure_cache.lookup(_key(new)) is None  # measured again
    measure_cache.store(_key(new), 1.5)
    assert measure_cache.lookup(_key(new)) == 1.5 and measure_cache.lookup(_key(old)) == 2.5


class _Keyed(Exception):
    """Raised by the recording `key`: the test needs the key's modules, not the measurement."""


@pytest.fixture
def key_modules(monkeypatch):
    """The `modules` each measurement's key is made with (the measurement itself does not run)."""
    seen: list[tuple[str, ...]] = []

    def recording(kind, *, modules, dtype, **shape):
        seen.append(modules)
        raise _Keyed

    monkeypatch.setattr(measure_cache, "key", recording)
    return seen


def test_the_cpu_kernels_are_keyed_by_the_modules_they_live_in(key_modules):
    """The attention tiles' and the linear kernels' entries name the modules holding the timed
    code, as they are named today (a name left behind by a move would not import)."""
    import importlib
    import time

    from models.attention import lse, tiles
    from models.linear import packed, quant, select

    lse._measure.cache_clear()
    with pytest.raises(_Keyed):
        lse._measure(4, 2, 16, 1)
    lse._measure.cache_clear()
    with pytest.raises(_Keyed):
        select._measured(["onednn-packed", "F.linear"], [], time.perf_counter)
    assert key_modules == [(tiles.__name__, lse.__name__), (packed.__name__, quant.__name__, select.__name__)]
    assert all(importlib.import_module(name) for names in key_modules for name in names)
