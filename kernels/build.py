"""Building the CUDA extensions, stamping what they were built for, and loading them back.

``python -m kernels.build`` (run by ``docker build``, and by a server start that finds no usable
library, in a subprocess with a timeout) compiles every extension into
``$TORCH_EXTENSIONS_DIR/<name>/<stamp digest>/``; no GPU is needed to compile.

Invariant: a library is imported only when its stamp equals what this process would build now:
the sources' sha256, torch's version, torch's CUDA version, the arch list and the compiler
flags. Any difference (a torch upgrade under a bare-pip cache, another arch list, edited
sources) is another directory, so a stale .so is never imported; it is rebuilt instead.
NOTE: a fresh process calling cpp_extension.load always re-enters the ninja build step, which
needs ninja, nvcc and CUDA_HOME: none of them exist in the runtime image, so loading goes
through ``load_prebuilt`` and building through a subprocess.
NOTE: torch's FileBaton waits forever on a ``lock`` left by a killed build, so every build runs
in a fresh private directory (``tmp-<pid>-*``) that is renamed into place when it succeeds; a
killed build leaves only that directory behind, removed by the next build once its pid is dead.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)

STALE_BUILD_S = 3600.0  # a private build dir older than this is abandoned, whatever its pid


@dataclass(frozen=True)
class Extension:
    """One CUDA extension: its module name, sources and nvcc flags (all part of its stamp)."""

    name: str
    sources: tuple[Path, ...]
    cuda_flags: tuple[str, ...]


GATHER = Extension("radixserve_gather", (Path(__file__).with_name("gather.cu"),),
                   ("-O3", "--expt-relaxed-constexpr"))
EXTENSIONS = (GATHER,)  # what ``python -m kernels.build`` builds


def extension_root() -> Path:
    """Where builds live: $TORCH_EXTENSIONS_DIR, else ~/.cache/radixserve/torch_extensions."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "radixserve" / "torch_extensions"


def source_digest(sources: Sequence[Path]) -> str:
    """sha256 over the sources' bytes, in order: what a prebuilt .so was compiled from."""
    h = hashlib.sha256()
    for src in sources:
        h.update(Path(src).read_bytes())
    return h.hexdigest()


def arch_list() -> str:
    """The archs a build here targets: $TORCH_CUDA_ARCH_LIST, else (as torch does) the visible
    GPUs' compute capabilities."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env:
        return env
    import torch

    if not torch.cuda.is_available():
        return "unset"
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return "visible:" + ";".join(f"{a}.{b}" for a, b in caps)


def stamp_fields(sources: Sequence[Path], flags: Sequence[str], *, torch_version: str | None = None,
                 cuda_version: str | None = None, archs: str | None = None) -> dict:
    """Everything a compiled library depends on (keyword overrides are for tests)."""
    import torch

    return {
        "sources_sha256": source_digest(sources),
        "torch": torch_version if torch_version is not None else torch.__version__,
        "cuda": cuda_version if cuda_version is not None else str(torch.version.cuda),
        "archs": archs if archs is not None else arch_list(),
        "flags": list(flags),
    }


def stamp_digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def library_dir(root: Path, name: str, fields: dict) -> Path:
    """Where the library for exactly these stamp fields lives."""
    return Path(root) / name / stamp_digest(fields)


def write_stamp(build_dir: Path, name: str, fields: dict) -> None:
    (Path(build_dir) / f"{name}.stamp.json").write_text(json.dumps(fields, indent=1, sort_keys=True))


def check_stamp(build_dir: Path, name: str, fields: dict) -> str | None:
    """None when ``build_dir`` holds a library stamped with exactly ``fields``, else why not."""
    so, stamp = Path(build_dir) / f"{name}.so", Path(build_dir) / f"{name}.stamp.json"
    if not so.is_file():
        return f"no prebuilt library {so}"
    try:
        have = json.loads(stamp.read_text())
    except (OSError, ValueError) as exc:
        return f"unreadable stamp {stamp}: {exc}"
    changed = sorted(k for k in set(have) | set(fields) if have.get(k) != fields.get(k))
    return f"stale library (changed: {', '.join(changed)})" if changed else None


def load_prebuilt(name: str, build_dir: Path, fields: dict):
    """(module, None) from ``build_dir/name.so`` when its stamp matches, else (None, reason)."""
    reason = check_stamp(build_dir, name, fields)
    if reason is not None:
        return None, reason
    import torch  # noqa: F401 - the extension links against libtorch; load it first

    so = Path(build_dir) / f"{name}.so"
    try:
        loader = importlib.machinery.ExtensionFileLoader(name, str(so))
        spec = importlib.util.spec_from_file_location(name, str(so), loader=loader)
        if spec is None:
            raise ImportError(f"no module spec for {so}")
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - an undefined symbol after an ABI change, ...
        return None, f"import of {so} failed: {type(exc).__name__}: {exc}"
    return module, None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clear_abandoned_builds(parent: Path, *, max_age_s: float = STALE_BUILD_S) -> list[Path]:
    """Remove ``tmp-<pid>-*`` build dirs whose process is gone (or that are older than
    ``max_age_s``): what a killed build leaves. Returns the removed paths."""
    removed = []
    for d in Path(parent).glob("tmp-*"):
        try:
            pid = int(d.name.split("-")[1])
            age = time.time() - d.stat().st_mtime
        except (ValueError, IndexError, OSError):
            continue
        if (pid != os.getpid() and not _pid_alive(pid)) or age > max_age_s:
            log.warning("removing abandoned extension build %s (pid %d, %.0f s old)", d, pid, age)
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def build_now(ext: Extension, root: Path | None = None) -> Path:
    """Compile ``ext`` into a private ``tmp-<pid>-*`` directory, stamp it, rename it into place.

    Returns the library directory. Runs in ``python -m kernels.build`` (image build, or the
    subprocess a start-up without a usable library runs), never inside a serving process.
    """
    from torch.utils import cpp_extension  # NOTE: imported lazily; never at module import

    fields = stamp_fields(ext.sources, ext.cuda_flags)
    final = library_dir(root or extension_root(), ext.name, fields)
    final.parent.mkdir(parents=True, exist_ok=True)
    clear_abandoned_builds(final.parent)
    work = Path(tempfile.mkdtemp(prefix=f"tmp-{os.getpid()}-", dir=final.parent))
    try:
        cpp_extension.load(name=ext.name, sources=[str(src) for src in ext.sources],
                           build_directory=str(work), extra_cuda_cflags=list(ext.cuda_flags), verbose=False)
        write_stamp(work, ext.name, fields)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(work, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def run_build(cmd: Sequence[str], *, timeout_s: float, env: dict | None = None) -> str | None:
    """Run a build command in its own process group; None on success, else why it failed.

    On timeout the whole group (ninja, nvcc) is killed, so start-up waits at most timeout_s.
    """
    try:
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, start_new_session=True)
    except OSError as exc:
        return f"could not start {cmd[0]}: {exc}"
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"build timed out after {timeout_s:g} s (killed)"
    if proc.returncode != 0:
        tail = " | ".join((out or "").strip().splitlines()[-3:])
        return f"build exited {proc.returncode}: {tail[-400:]}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Build every CUDA extension now; non-zero exit when torch has no CUDA or a build fails."""
    p = argparse.ArgumentParser(prog="python -m kernels.build", description=main.__doc__)
    p.add_argument("--root", default=None, help="extension root (default $TORCH_EXTENSIONS_DIR)")
    args = p.parse_args(argv)
    import torch

    if torch.version.cuda is None:
        print("kernels.build: this torch has no CUDA support; nothing to build", file=sys.stderr)
        return 2
    for ext in EXTENSIONS:
        try:
            where = build_now(ext, Path(args.root) if args.root else None)
        except Exception as exc:  # noqa: BLE001 - report any compiler failure and fail the build
            print(f"kernels.build: {ext.name} failed: {exc}", file=sys.stderr)
            return 1
        print(f"kernels.build: {ext.name} built in {where}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
