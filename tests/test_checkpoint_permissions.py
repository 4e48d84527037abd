"""An unreadable checkpoint is reported at start as a permission problem naming the uid to grant.

The case from the field: a root-owned model directory (save_pretrained writes model.safetensors
as 0600) mounted into the image, whose user is uid 10001. safetensors reports such a file as "No
such file or directory"; models.checkpoint.loader.check_readable names it before any read.

Tests run as root here, and root reads everything: the checks then run in a forked child that
drops to uid/gid 65534 (nobody) on real files, so the kernel, not a mock, denies the read. Run
as another user, the same test needs no fork. tests/test_container_image.py covers the mounted
case in the image end to end.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from models.checkpoint.loader import check_readable, resolve_model_dir

OTHER_UID = 65534


def _as_other_user(fn) -> str:
    """fn() run without root's read-everything: its PermissionError message, or "" if none."""
    if os.getuid() != 0:
        try:
            fn()
        except PermissionError as exc:
            return str(exc)
        return ""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, report through the pipe, never return into pytest
        code = 0
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            try:
                fn()
                message = ""
            except PermissionError as exc:
                message = str(exc)
            os.write(write, message.encode() or b"-")
        except BaseException as exc:  # noqa: BLE001 - anything else is a test failure, reported as such
            os.write(write, f"!{type(exc).__name__}: {exc}".encode())
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        out = pipe.read().decode()
    os.waitpid(pid, 0)
    assert not out.startswith("!"), out
    return "" if out == "-" else out


@pytest.fixture
def model_dir():
    """A checkpoint-shaped directory outside pytest's 0700 tmp tree, so uid 65534 can reach it."""
    root = Path(tempfile.mkdtemp(prefix="radixserve-perm-"))
    root.chmod(0o755)
    d = root / "m"
    d.mkdir()
    d.chmod(0o755)
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (d / name).write_text("{}")
        (d / name).chmod(0o644)
    (d / "training_args.bin").write_text("not read by the loader")
    yield d
    shutil.rmtree(root)


def test_readable_checkpoint_passes(model_dir):
    (model_dir / "training_args.bin").chmod(0o600)  # a file the loader never opens does not matter
    assert _as_other_user(lambda: check_readable(model_dir)) == ""


def test_unreadable_weights_name_the_file_and_the_uid(model_dir):
    weights = model_dir / "model.safetensors"
    weights.chmod(0o600)  # what save_pretrained writes
    message = _as_other_user(lambda: resolve_model_dir(str(model_dir)))
    uid = os.getuid() if os.getuid() != 0 else OTHER_UID
    assert message.startswith(f"cannot read {weights} as uid {uid} ("), message
    assert "mode 0600" in message and f"owner uid {weights.stat().st_uid}" in message, message
    assert f"chown -R {uid} {model_dir}" in message and "\n" not in message, message


def test_several_unreadable_files_are_counted(model_dir):
    for name in ("config.json", "model.safetensors"):
        (model_dir / name).chmod(0o600)
    message = _as_other_user(lambda: check_readable(model_dir))
    assert message.startswith(f"cannot read {model_dir / 'config.json'} and 1 more as uid "), message


def test_untraversable_directory_is_named(model_dir):
    model_dir.chmod(0o700)
    message = _as_other_user(lambda: resolve_model_dir(str(model_dir)))
    assert message.startswith(f"cannot read model directory {model_dir} as uid "), message
    assert "mode 0700" in message, message


def test_an_unreadable_card_is_named(model_dir):
    """The model card is read (a one-label head's reranker mark), so an unreadable one is named at
    start rather than read as no card, which would serve the head as another kind in silence."""
    card = model_dir / "README.md"
    card.write_text("# a card")
    card.chmod(0o600)
    assert "README.md" in _as_other_user(lambda: check_readable(model_dir))
