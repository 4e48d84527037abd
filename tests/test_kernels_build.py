"""kernels.build: source stamps decide whether a prebuilt extension may be imported."""
from __future__ import annotations

import pytest
import torch

from kernels import build, gather


def test_stamp_matches_only_the_same_sources(tmp_path):
    src = tmp_path / "a.cu"
    src.write_text("__global__ void k() {}\n")
    (tmp_path / "ext.so").write_bytes(b"not a real library")
    assert build.load_prebuilt("ext", tmp_path, [src]) is None  # no stamp yet
    build.write_stamp(tmp_path, "ext", [src])
    assert build.stamp_path(tmp_path, "ext").read_text().strip() == build.source_digest([src])
    src.write_text("__global__ void k() { /* changed */ }\n")
    assert build.load_prebuilt("ext", tmp_path, [src]) is None  # stale stamp: rebuild, never import


def test_digest_covers_every_source_in_order(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("x")
    b.write_text("y")
    assert build.source_digest([a, b]) != build.source_digest([b, a])
    assert build.source_digest([gather.SOURCE]) == build.source_digest([gather.SOURCE])


def test_main_refuses_without_cuda_torch(capsys):
    if torch.version.cuda is not None:
        pytest.skip("a CUDA torch really compiles here; loadtest.gpu_check covers it")
    assert build.main([]) == 2
    assert "no CUDA support" in capsys.readouterr().err
