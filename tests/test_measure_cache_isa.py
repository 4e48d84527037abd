"""The measurement cache keys by the instruction set the kernels may use, not only by the CPU.

A process whose libraries are capped to AVX2 (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``,
``MKL_ENABLE_INSTRUCTIONS``) on an AVX-512 CPU runs other kernels than an uncapped one on the same
CPU: it must measure its own choice instead of reading the uncapped process's figures.
"""
from __future__ import annotations

import pytest
import torch

from models import measure_cache
from models.attention import lse as attention_lse
SHAPE = {"heads": 4, "kv_heads": 2, "head_dim": 16}


@pytest.fixture
def clean(tmp_path, monkeypatch):
    monkeypatch.setenv(measure_cache.ENV, str(tmp_path / "measurements.json"))
    for name in measure_cache.ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    attention_lse._measure.cache_clear()
    yield
    attention_lse._measure.cache_clear()


def _key() -> str:
    return measure_cache.key("k", modules=("models.measure_cache",), dtype=torch.float32, rows=4)


@pytest.mark.parametrize("name, value", [("ONEDNN_MAX_CPU_ISA", "AVX2"), ("DNNL_MAX_CPU_ISA", "AVX2"),
                                         ("MKL_ENABLE_INSTRUCTIONS", "AVX2"), ("ATEN_CPU_CAPABILITY", "avx2")])
def test_an_isa_cap_in_the_environment_is_another_key(clean, monkeypatch, name, value):
    plain = _key()
    monkeypatch.setenv(name, value)
    assert _key() != plain
    monkeypatch.setenv(name, "")  # set but empty: no cap
    assert _key() == plain


def test_torchs_capability_is_part_of_the_key(clean, monkeypatch):
    plain = _key()
    other = "AVX2" if torch.backends.cpu.get_cpu_capability() != "AVX2" else "DEFAULT"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: other)
    assert _key() != plain


def test_a_capped_process_measures_instead_of_reading_the_uncapped_figure(clean, monkeypatch):
    gains = iter([3.0, 0.5])
    runs: list[tuple] = []

    def timed(*shape):
        runs.append(shape)
        return next(gains)

    monkeypatch.setattr(attention_lse, "_time_tiles", timed)
    assert attention_lse.select_cpu_kernel(True, **SHAPE).startswith("onednn-tiles")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    attention_lse._measure.cache_clear()  # a new process, capped
    assert attention_lse.select_cpu_kernel(True, **SHAPE).startswith("flash") and len(runs) == 2
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    attention_lse._measure.cache_clear()  # uncapped again: its own figure, from the cache
    assert attention_lse.select_cpu_kernel(True, **SHAPE).startswith("onednn-tiles") and len(runs) == 2


def _cpuinfo(model: str, flags: str = "fpu avx2 avx512f") -> str:
    one = f"processor\t: {{}}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: {model}\nmodel name\t: AMD EPYC\n" \
          f"stepping\t: 1\nflags\t\t: {flags}\n"
    return "\n".join(one.format(i) for i in range(2))


def test_one_brand_and_flag_set_on_two_microarchitectures_are_two_keys():
    """Under KVM, Zen 3/4/5 may all read "AMD EPYC" with one flag set: family/model split them."""
    zen4, genoa_b = measure_cache.describe_cpu(_cpuinfo("17")), measure_cache.describe_cpu(_cpuinfo("17"))
    assert zen4 == genoa_b and "25/17/1" in zen4
    assert measure_cache.describe_cpu(_cpuinfo("1")) != zen4
    assert measure_cache.describe_cpu(_cpuinfo("17", flags="fpu avx2")) != zen4
