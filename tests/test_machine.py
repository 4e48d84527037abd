"""loadtest/machine.py: the machine line every report prints, read from /proc/cpuinfo's text.

The samples are the first processor's block of machines the docs' tables come from (the flags cut
to the ones that matter plus a few others): the line must tell apart what a model name alone does
not (Zen 3 and Zen 4 both read "AMD EPYC" under KVM), and say what it could not read.
"""
from __future__ import annotations

import platform

from loadtest import machine

_X86 = """processor\t: 0
vendor_id\t: {vendor}
cpu family\t: {family}
model\t\t: {model}
model name\t: {name}
stepping\t: {stepping}
flags\t\t: fpu vme sse sse2 {flags}
bogomips\t: 4000.00

processor\t: 1
vendor_id\t: SomeoneElse
flags\t\t: fpu
"""


def _x86(vendor: str, family: str, model: str, name: str, stepping: str, flags: str) -> str:
    return _X86.format(vendor=vendor, family=family, model=model, name=name, stepping=stepping, flags=flags)


def test_two_microarchitectures_under_one_model_name_read_apart():
    zen3 = machine.describe(_x86("AuthenticAMD", "25", "1", "AMD EPYC", "1", "avx2 fma hypervisor"), cpus=2)
    zen4 = machine.describe(_x86("AuthenticAMD", "25", "17", "AMD EPYC", "0",
                                 "avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_vnni hypervisor"), cpus=2)
    assert (zen3["model_name"], zen3["family"]) == (zen4["model_name"], zen4["family"]) == ("AMD EPYC", "25")
    assert (zen3["model"], zen4["model"]) == ("1", "17")
    assert zen3["simd"] == ["avx2", "fma"]
    assert zen4["simd"] == ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"]
    assert machine.line(zen3) == 'AuthenticAMD "AMD EPYC" family 25 model 1 stepping 1, 2 CPUs, under a hypervisor; avx2 fma'
    assert machine.line(zen3) != machine.line(zen4)


def test_intel_with_amx_and_the_load_at_both_ends():
    text = _x86("GenuineIntel", "6", "167", "Intel(R) Xeon(R) Processor", "1",
                "avx2 fma avx512f avx512_bf16 avx512_fp16 amx_tile amx_bf16 amx_int8 hypervisor")
    m = machine.describe(text, cpus=2, load=(0.834, 1.2, 1.0))
    assert m["vendor"] == "GenuineIntel" and m["hypervisor"] and m["load_start"] == [0.83, 1.2, 1.0]
    m["load_end"] = [2.06, 1.5, 1.1]  # what `finish` adds at the end of a run
    assert machine.line(m) == ('GenuineIntel "Intel(R) Xeon(R) Processor" family 6 model 167 stepping 1, 2 CPUs, '
                               "under a hypervisor; avx2 fma avx512f avx512_bf16 avx512_fp16 amx_tile amx_bf16 "
                               "amx_int8; load average 0.8 at the start, 2.1 at the end")


def test_arm_and_an_unreadable_cpuinfo_leave_out_what_they_lack():
    arm = machine.describe("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd asimddp sve i8mm\n"
                           "CPU implementer\t: 0x41\nCPU part\t: 0xd40\n", cpus=4)
    assert arm["simd"] == ["asimd", "asimddp", "sve", "i8mm"] and "vendor" not in arm and not arm["hypervisor"]
    assert machine.line(arm) == "0x41 part 0xd40, 4 CPUs; asimd asimddp sve i8mm"
    empty = machine.describe("")
    assert machine.line(empty) == f"{platform.machine() or '?'}; no SIMD flags read"


def test_an_isa_cap_in_the_environment_is_named(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    now = machine.current()
    assert now["isa_caps"] == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert "(capped: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2)" in machine.line(now)


def test_the_caps_named_are_the_ones_the_measurement_cache_keys_on():
    from models import measure_cache  # the server's side; loadtest itself never imports torch

    assert machine.ISA_CAPS == measure_cache.ISA_ENV


def test_this_machine_and_its_end_of_run_load(monkeypatch):
    for name in machine.ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    now = machine.current()
    assert "isa_caps" not in now and "capped" not in machine.line(now)
    assert now["cpus"] >= 1 and len(now["load_start"]) == 3
    done = machine.finish(now)
    assert done["load_end"] and {k: v for k, v in done.items() if k != "load_end"} == now
