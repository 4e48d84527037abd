"""The start-up measurements' cache: a kernel choice timed once per machine and model shape.

`select_cpu_kernel` (models/attention/lse.py) and `choose_linears` (models/linear/select.py) time
candidate kernels on the model's shapes at load: seconds of start-up, the same answer every time on
one machine. Their figures are kept in one small JSON file, under a key made of everything the
figure depends on: the measurement's kind and shapes, the CPU (model name and flags), the
instruction set the libraries may use (torch's CPU capability and the ISA caps set in the
environment: ``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``...; a
process capped to AVX2 on an AVX-512 CPU runs other kernels, so it measures its own), torch's
version and build, the thread count, the dtype, and the names of the modules whose kernels were
timed with a hash of their source (a changed kernel is measured again, and so is a moved one: an
entry stored under a module's old name is never read under its new one). A missing, unreadable or foreign entry is
a miss: the measurement runs and the entry is written (atomically; a failed write only logs).

``RADIXSERVE_MEASURE_CACHE``: unset, the file is ``$XDG_CACHE_HOME/radixserve/measurements.json``
(``~/.cache/...``); ``off`` (or ``0``, ``false``) measures at every start; another value is the
file's path.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

ENV = "RADIXSERVE_MEASURE_CACHE"
VERSION = 1  # of the file's layout
MAX_ENTRIES = 256  # the oldest go first: one machine serves few shapes


def cache_file() -> Path | None:
    """Where the cache lives, or None when it is off."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in ("off", "0", "false", "no"):
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "radixserve" / "measurements.json"


@functools.cache
def _cpu() -> str:
    """The CPU's model name, family/model/stepping and a hash of its flags (Linux /proc/cpuinfo;
    else the platform). NOTE: under a hypervisor the model name may be only the vendor's brand
    ("AMD EPYC" for Zen 3, 4 and 5 alike), and one flag set spans microarchitectures whose
    kernels run at different speeds (Zen 4 executes AVX-512 in 256-bit halves, Zen 5 does not):
    family and model tell them apart, so one's timing is never read on the other."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    return describe_cpu(text)


def describe_cpu(cpuinfo: str) -> str:
    """The key's CPU part from /proc/cpuinfo's text (its first processor's fields)."""
    fields = dict(line.split(":", 1) for line in cpuinfo.split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = hashlib.sha1(fields.get("flags", "").encode()).hexdigest()[:12]
    arch = "/".join(fields.get(k, "?") for k in ("cpu family", "model", "stepping"))
    return f"{fields.get('model name', '?')} family/model/stepping:{arch} flags:{flags}"


# environment variables that cap or change the instruction set of torch's, oneDNN's and MKL's kernels
# (loadtest/machine.py names the same ones in every report: tests/test_machine.py holds them equal)
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_CPU_ISA_HINTS",
           "DNNL_CPU_ISA_HINTS", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "MKL_DEBUG_CPU_TYPE")


def _isa() -> dict[str, str]:
    """torch's CPU capability as this process runs it, and every ISA cap set in the environment."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        capability = "?"
    caps = {name: os.environ[name] for name in ISA_ENV if os.environ.get(name)}
    return {"torch": capability, **caps}


@functools.cache
def _source_hash(modules: tuple[str, ...]) -> str:
    """A hash of the named modules' source files: a kernel's change invalidates its entries."""
    import importlib

    digest = hashlib.sha1()
    for name in modules:
        file = getattr(importlib.import_module(name), "__file__", None)
        digest.update(Path(file).read_bytes() if file else name.encode())
    return digest.hexdigest()[:16]


def key(kind: str, *, modules: tuple[str, ...], dtype: torch.dtype, **shape: Any) -> str:
    """The entry's key: `kind`, `shape`, and the machine, ISA caps, torch, threads, dtype, and the
    timed modules' names and source."""
    parts = {"kind": kind, "cpu": _cpu(), "isa": _isa(), "torch": f"{torch.__version__} {torch.version.git_version}",
             "threads": torch.get_num_threads(), "dtype": str(dtype), "modules": list(modules),
             "code": _source_hash(modules), "shape": shape}
    return json.dumps(parts, sort_keys=True, default=str)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def lookup(entry: str) -> Any | None:
    """The cached figure under `entry` (a `key`), or None (off, missing, unreadable)."""
    path = cache_file()
    return None if path is None else _read(path).get(entry)


def store(entry: str, value: Any) -> None:
    """Keep `value` under `entry`; a write that fails is logged and forgotten."""
    path = cache_file()
    if path is None:
        return
    try:
        entries = _read(path)
        entries.pop(entry, None)
        entries[entry] = value
        while len(entries) > MAX_ENTRIES:
            entries.pop(next(iter(entries)))
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".measurements.")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": VERSION, "entries": entries}, f)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError) as exc:
        log.warning("could not write the measurement cache %s (%s): the next start measures again; "
                    "%s=PATH moves it, =off stops trying", path, exc, ENV)
