"""Ahead-of-time build of the CUDA extensions, and loading what such a build left behind.

``python -m kernels.build`` (run by ``docker build``) compiles every extension for
$TORCH_CUDA_ARCH_LIST into $TORCH_EXTENSIONS_DIR; no GPU is needed to compile. Each build is
stamped with the sha256 of its sources, so a process that finds a matching stamp imports the
prebuilt .so directly (``load_prebuilt``) instead of calling cpp_extension.load again.
NOTE: a fresh process calling cpp_extension.load always re-enters the ninja build step, which
needs ninja, nvcc and CUDA_HOME: none of them exist in the runtime image.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)


def source_digest(sources: Sequence[Path]) -> str:
    """sha256 over the sources' bytes, in order: what a prebuilt .so was compiled from."""
    h = hashlib.sha256()
    for src in sources:
        h.update(Path(src).read_bytes())
    return h.hexdigest()


def stamp_path(build_dir: Path, name: str) -> Path:
    return Path(build_dir) / f"{name}.sha256"


def write_stamp(build_dir: Path, name: str, sources: Sequence[Path]) -> None:
    stamp_path(build_dir, name).write_text(source_digest(sources) + "\n")


def load_prebuilt(name: str, build_dir: Path, sources: Sequence[Path]):
    """The extension module from ``build_dir/name.so`` when its stamp matches the sources, else None."""
    so = Path(build_dir) / f"{name}.so"
    stamp = stamp_path(build_dir, name)
    if not so.is_file() or not stamp.is_file():
        return None
    if stamp.read_text().strip() != source_digest(sources):
        log.info("prebuilt %s is stale (sources changed); rebuilding", so)
        return None
    import torch  # noqa: F401 - the extension links against libtorch; load it first

    loader = importlib.machinery.ExtensionFileLoader(name, str(so))
    spec = importlib.util.spec_from_file_location(name, str(so), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    """Build every CUDA extension now; non-zero exit when torch has no CUDA or a build fails."""
    import torch

    from kernels import gather

    if torch.version.cuda is None:
        print("kernels.build: this torch has no CUDA support; nothing to build", file=sys.stderr)
        return 2
    try:
        gather.build_now()
    except Exception as exc:  # noqa: BLE001 - report any compiler failure and fail the build
        print(f"kernels.build: {gather.EXTENSION_NAME} failed: {exc}", file=sys.stderr)
        return 1
    print(f"kernels.build: {gather.EXTENSION_NAME} built in {gather.extension_root() / gather.EXTENSION_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
