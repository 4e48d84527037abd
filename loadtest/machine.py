"""The machine a figure comes from, as the reports print it.

A CPU figure holds on the CPU it was measured on: the same model name can be several
microarchitectures (under KVM "AMD EPYC" is Zen 3, 4 or 5 alike, and Zen 4 runs AVX-512 as two
256-bit halves), and the load the machine carried moves every latency. So every report of the
load tester and of the benchmarks names the vendor, the model name, family/model/stepping (what
tells microarchitectures apart), the SIMD extensions the kernels choose between, the CPUs this
process may run on, whether it runs under a hypervisor, and the load average at the start and
at the end of the run. Read from Linux's /proc/cpuinfo and the OS; elsewhere the fields it
cannot read are left out rather than guessed.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

# x86 flags that decide which kernels run (oneDNN, MKL, torch's own), in the order printed
X86_SIMD = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
            "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
# the Arm ones: NEON dot product, SVE, bf16 and int8 matrix multiply
ARM_SIMD = ("asimd", "asimddp", "sve", "sve2", "bf16", "i8mm")
# environment variables that cap or change the kernels' instruction set (models/measure_cache.py
# keys its measurements on the same ones); a server a run starts inherits them
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_CPU_ISA_HINTS",
            "DNNL_CPU_ISA_HINTS", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "MKL_DEBUG_CPU_TYPE")


def describe(cpuinfo: str, *, cpus: int | None = None, load: tuple[float, ...] | None = None) -> dict:
    """The machine from /proc/cpuinfo's text (its first processor's fields), the CPU count and
    the load average (1, 5, 15 minutes). Keys absent from the text are absent from the result."""
    block = cpuinfo.split("\n\n")[0]
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in block.splitlines()) if v}
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    out: dict = {"arch": platform.machine() or "?"}
    for key, name in (("vendor_id", "vendor"), ("model name", "model_name"), ("cpu family", "family"),
                      ("model", "model"), ("stepping", "stepping"), ("CPU implementer", "implementer"),
                      ("CPU part", "part")):
        if fields.get(key):
            out[name] = fields[key]
    out["simd"] = [f for f in (X86_SIMD if "flags" in fields else ARM_SIMD) if f in flags]
    out["hypervisor"] = "hypervisor" in flags
    if cpus is not None:
        out["cpus"] = cpus
    if load is not None:
        out["load_start"] = [round(x, 2) for x in load]
    return out


def current() -> dict:
    """This machine now (the CPUs this process may use, the load average now, the ISA caps set in
    the environment)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    try:
        cpus: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count()
    caps = {name: os.environ[name] for name in ISA_CAPS if os.environ.get(name)}
    return {**describe(text, cpus=cpus, load=_load()), **({"isa_caps": caps} if caps else {})}


def finish(machine: dict) -> dict:
    """``machine`` with the load average at the end of the run added."""
    load = _load()
    return {**machine, **({"load_end": [round(x, 2) for x in load]} if load is not None else {})}


def line(machine: dict) -> str:
    """One line for a report, e.g. ``GenuineIntel "Intel(R) Xeon(R) Processor" family 6 model 167
    stepping 1, 2 CPUs, under a hypervisor; avx2 fma avx512f ... amx_int8; load average 0.8 at the
    start, 2.1 at the end``."""
    who = " ".join(x for x in (machine.get("vendor") or machine.get("implementer"),
                               f'"{machine["model_name"]}"' if machine.get("model_name") else None) if x)
    arch = " ".join(f"{k} {machine[k]}" for k in ("family", "model", "stepping", "part") if k in machine)
    parts = [" ".join(x for x in (who or machine.get("arch", "?"), arch) if x)]
    if "cpus" in machine:
        parts.append(f"{machine['cpus']} CPUs")
    if machine.get("hypervisor"):
        parts.append("under a hypervisor")
    text = ", ".join(parts) + "; " + (" ".join(machine.get("simd", [])) or "no SIMD flags read")
    if machine.get("isa_caps"):  # e.g. ATEN_CPU_CAPABILITY=avx2: the kernels run below the flags
        text += " (capped: " + " ".join(f"{k}={v}" for k, v in machine["isa_caps"].items()) + ")"
    loads = [f"{machine[k][0]:.1f} at the {k[5:]}" for k in ("load_start", "load_end") if machine.get(k)]
    return text + (f"; load average {', '.join(loads)}" if loads else "")


def _load() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except (AttributeError, OSError):
        return None
