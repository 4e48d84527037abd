"""kernels.build and the gather library's loading policy, on the CPU with stand-ins.

Stamps: a library is imported only when sources, torch, CUDA, archs and flags all match.
Loading: a library that fails to import or fails its self-test (wrong rows, or "no kernel image
is available") is rebuilt once in a subprocess with a timeout, then dropped with a WARNING.
Builds: private directories, so a killed build's lock never blocks the next one.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
import torch

import kernels
from kernels import build, gather
from tests.test_kernels import _clean_state  # noqa: F401 - autouse: env and cached state

FLAGS = ["-O3"]


def _fields(src, **over):
    kw = dict(torch_version="2.13.0", cuda_version="12.8", archs="8.0;9.0") | over
    flags = kw.pop("flags", FLAGS)
    return build.stamp_fields([src], flags, **kw)


def _library(tmp_path, fields, *, name="ext", payload=b"not a real library"):
    d = build.library_dir(tmp_path, name, fields)
    d.mkdir(parents=True)
    (d / f"{name}.so").write_bytes(payload)
    build.write_stamp(d, name, fields)
    return d


def test_stamp_covers_sources_torch_cuda_archs_and_flags(tmp_path):
    src = tmp_path / "a.cu"
    src.write_text("__global__ void k() {}\n")
    base = _fields(src)
    d = _library(tmp_path, base)
    assert build.check_stamp(d, "ext", base) is None
    variants = {"torch": _fields(src, torch_version="2.14.0"),
                "cuda": _fields(src, cuda_version="13.0"),
                "archs": _fields(src, archs="8.0;9.0;10.0"),
                "flags": _fields(src, flags=["-O3", "-lineinfo"])}
    src.write_text("__global__ void k() { /* changed */ }\n")
    variants["sources_sha256"] = _fields(src)
    for key, fields in variants.items():
        reason = build.check_stamp(d, "ext", fields)
        assert reason == f"stale library (changed: {key})", key
        assert build.library_dir(tmp_path, "ext", fields) != d  # another directory, never reused
        module, why = build.load_prebuilt("ext", d, fields)
        assert module is None and why == reason


def test_missing_or_unimportable_library_is_a_reason_not_a_crash(tmp_path):
    src = tmp_path / "a.cu"
    src.write_text("x")
    fields = _fields(src)
    assert build.load_prebuilt("ext", tmp_path / "nowhere", fields)[1].startswith("no prebuilt")
    d = _library(tmp_path, fields)  # the stamp matches, but the .so is garbage
    module, why = build.load_prebuilt("ext", d, fields)
    assert module is None and why.startswith("import of") and "failed" in why


def test_digest_covers_every_source_in_order(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("x")
    b.write_text("y")
    assert build.source_digest([a, b]) != build.source_digest([b, a])
    assert build.source_digest([gather.SOURCE]) == build.source_digest([gather.SOURCE])


def test_gather_stamp_names_the_real_flags_and_arch_list(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    fields = gather.stamp_fields()
    assert fields["archs"] == "8.0;9.0+PTX" and fields["flags"] == list(gather.CUDA_FLAGS)
    assert fields["torch"] == torch.__version__ and fields["cuda"] == str(torch.version.cuda)


# ---------------------------------------------------------------- self-test and fallback

class _Ext:
    """Stands in for a loaded library, on CPU tensors."""

    def __init__(self, mode="good"):
        self.mode = mode

    def gather_rows(self, src, index):
        if self.mode == "raise":
            raise RuntimeError("CUDA error: no kernel image is available for execution on the device")
        out = src.index_select(0, index.long())
        return out.flip(0) if self.mode == "wrong" else out

    def gather_rows_pair(self, k, v, index):
        return self.gather_rows(k, index), self.gather_rows(v, index)


def test_self_test_catches_wrong_rows_and_launch_errors():
    assert gather.self_test(_Ext("good"), "cpu") is None
    assert gather.self_test(_Ext("wrong"), "cpu").startswith("self-test: wrong rows")
    assert "no kernel image is available" in gather.self_test(_Ext("raise"), "cpu")


@pytest.mark.parametrize("mode", ["wrong", "raise"])
def test_failing_library_is_rebuilt_once_then_dropped(mode, caplog):
    rebuilds = []
    check = lambda ext: gather.self_test(ext, "cpu")  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="kernels.gather"):
        ext, why = gather.resolve_library(load=lambda: (_Ext(mode), None),
                                          rebuild=lambda: rebuilds.append(1), check=check)
    assert ext is None and len(rebuilds) == 1 and why.startswith("after rebuild: self-test")
    assert any("rebuilding it once" in r.getMessage() and "self-test" in r.getMessage()
               for r in caplog.records)


def test_stale_library_rebuilt_then_used():
    state = {"built": False}

    def load():
        return (_Ext(), None) if state["built"] else (None, "stale library (changed: torch)")

    ext, why = gather.resolve_library(load=load, rebuild=lambda: state.update(built=True),
                                      check=lambda e: gather.self_test(e, "cpu"))
    assert isinstance(ext, _Ext) and why is None


def test_good_library_is_not_rebuilt():
    ext, why = gather.resolve_library(load=lambda: (_Ext(), None),
                                      rebuild=lambda: pytest.fail("must not rebuild"),
                                      check=lambda e: gather.self_test(e, "cpu"))
    assert ext is not None and why is None


def test_load_extension_falls_back_with_a_warning_naming_why(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gather, "_load", lambda: (_Ext("raise"), None))
    monkeypatch.setattr(gather, "self_test", lambda ext: "self-test raised RuntimeError: CUDA "
                        "error: no kernel image is available for execution on the device")
    builds = []
    monkeypatch.setattr(gather, "subprocess_build", lambda: builds.append(1) or "build exited 1: "
                        "nvcc: not found")
    monkeypatch.setenv("RADIXSERVE_GATHER_IMPL", "cuda")
    with caplog.at_level(logging.WARNING, logger="kernels.gather"):
        assert kernels.get_gather_rows("cuda") is kernels.ref_gather_rows
        assert kernels.get_gather_rows_pair("cuda") is kernels.ref_gather_rows_pair
        text = kernels.describe("cuda")
    assert builds == [1]  # once per process, however many callers
    assert "no kernel image" in text and "nvcc: not found" in text
    assert sum("falling back to torch" in r.getMessage() for r in caplog.records) == 1


# ---------------------------------------------------------------- builds: subprocess, locks

def test_build_subprocess_timeout_kills_the_whole_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
              f"'import time; time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(p.pid)); "
              f"time.sleep(60)")
    t0 = time.monotonic()
    why = build.run_build([sys.executable, "-c", script], timeout_s=2)
    assert why.startswith("build timed out after 2 s") and time.monotonic() - t0 < 20
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # reaped by init shortly after SIGKILL
        if not build._pid_alive(grandchild):
            break
        time.sleep(0.1)
    assert not build._pid_alive(grandchild)  # ninja/nvcc under the build die with it


def test_build_subprocess_failure_reports_its_output():
    why = build.run_build([sys.executable, "-c", "import sys; print('nvcc fatal: x'); sys.exit(3)"],
                          timeout_s=30)
    assert why.startswith("build exited 3") and "nvcc fatal: x" in why
    assert build.run_build([sys.executable, "-c", "pass"], timeout_s=30) is None


def test_subprocess_build_runs_kernels_build_with_this_checkout(monkeypatch):
    seen = {}
    monkeypatch.setattr(build, "run_build", lambda cmd, *, timeout_s, env: seen.update(
        cmd=cmd, timeout_s=timeout_s, env=env))
    gather.subprocess_build(timeout_s=7)
    assert seen["cmd"][1:] == ["-m", "kernels.build"] and seen["timeout_s"] == 7
    root = str(gather.SOURCE.resolve().parents[1])
    assert seen["env"]["PYTHONPATH"].split(os.pathsep)[0] == root


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_abandoned_build_dirs_are_removed_by_pid_or_age(tmp_path):
    dead = tmp_path / f"tmp-{_dead_pid()}-abc"
    mine = tmp_path / f"tmp-{os.getpid()}-def"
    live_old = tmp_path / f"tmp-{os.getppid()}-ghi"
    for d in (dead, mine, live_old):
        d.mkdir()
        (d / "lock").touch()  # torch's FileBaton would wait on this forever
    old = time.time() - 2 * build.STALE_BUILD_S
    os.utime(live_old, (old, old))
    removed = build.clear_abandoned_builds(tmp_path)
    assert sorted(removed) == sorted([dead, live_old]) and mine.exists()


def test_build_now_uses_a_private_dir_despite_a_killed_builds_lock(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    final = build.library_dir(tmp_path, gather.EXTENSION_NAME, gather.stamp_fields())
    killed = final.parent / f"tmp-{_dead_pid()}-xyz"
    killed.mkdir(parents=True)
    (killed / "lock").touch()
    seen = []

    def fake_load(*, name, sources, build_directory, **kw):
        seen.append(build_directory)
        assert not (tmp_path / build_directory / "lock").exists()
        (tmp_path / build_directory / f"{name}.so").write_bytes(b"so")
        return object()

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert build.build_now(build.GATHER, tmp_path) == final
    assert not killed.exists() and seen[0] != str(final)
    assert build.check_stamp(final, gather.EXTENSION_NAME, gather.stamp_fields()) is None
    assert not list(final.parent.glob("tmp-*"))


def test_main_refuses_without_cuda_torch(capsys):
    if torch.version.cuda is not None:
        pytest.skip("a CUDA torch really compiles here; benchmarks.gpu_check covers it")
    assert build.main([]) == 2
    assert "no CUDA support" in capsys.readouterr().err


@pytest.mark.gpu
def test_real_library_passes_its_self_test_on_this_gpu():
    """Build (or load) the real library and run the start-up self-test on the real device."""
    ext = gather.load_extension()
    assert ext is not None, gather.load_error()
    assert gather.self_test(ext, "cuda") is None
    fields = gather.stamp_fields()
    d = build.library_dir(build.extension_root(), gather.EXTENSION_NAME, fields)
    assert build.check_stamp(d, gather.EXTENSION_NAME, fields) is None
