"""benchmarks.bench_kernels and benchmarks.gpu_check: their rows, the GPU check's verdict and
report, and that the check runs every gpu-marked test file (CPU; figures are never asserted)."""
from __future__ import annotations

from pathlib import Path

import torch

from benchmarks import bench_kernels, gpu_check
from benchmarks.bench_kernels import compact_index
from tests.test_kernels import _FakeExt, _clean_state  # noqa: F401 - _clean_state is autouse


def test_bench_kernels_smoke(capsys):
    records = bench_kernels.main(["--tiny", "--device", "cpu", "--reps", "2", "--warmup", "1", "--json", "-"])
    out = capsys.readouterr().out
    assert "cpu, not meaningful" in out
    methods = {r["method"] for r in records}
    assert {"copy", "index_select", "advanced_indexing", "torch.gather"} <= methods
    for r in records:
        assert r["gb_per_s"] > 0 and r["ms"] > 0
        assert r["bytes"] == 2 * r["rows_out"] * r["row_bytes"] * r["tensors"]


def test_bench_kernel_rows_and_gpu_check_verdict():
    case = bench_kernels.Case("qwen3-0.6b", 1536, 768, heads=2, kv_heads=2, head_dim=8)
    records = bench_kernels.run([case], device=torch.device("cpu"), dtype=torch.float16,
                                warmup=0, reps=1, ext=_FakeExt())
    assert {("kernel", "strided"), ("kernel pair (K,V)", "strided")} <= {
        (r["method"], r["source"]) for r in records}
    (line,) = gpu_check._verdict(records)
    assert line.startswith("- qwen3-0.6b N=1536: copy") and "pair: kernel" in line


def test_gpu_check_writes_report(tmp_path):
    rc = gpu_check.main(["--out", str(tmp_path), "--skip-tests", "--skip-bench"])
    md = (tmp_path / "gpu_check.md").read_text()
    report = (tmp_path / "gpu_check.json").read_text()
    built = torch.cuda.is_available()
    assert ("## build: ok" in md) == built and (rc == 0) == built
    assert '"cuda_available": %s' % str(built).lower() in report
    assert "## attention:" in md and "## serving:" in md


def test_gpu_check_runs_every_gpu_marked_test_file():
    files = gpu_check.gpu_test_files()
    root = Path(gpu_check.ROOT)
    marked = {f"tests/{p.name}" for p in (root / "tests").glob("test_*.py")
              if "pytest.mark.gpu" in p.read_text() or "GPU = pytest.mark.gpu" in p.read_text()}
    serving = {gpu_check.SERVING_TESTS}  # run on its own, in the report's "serving" section
    assert gpu_check.SERVING_TESTS in marked
    assert marked - serving and marked - serving <= set(files) and not serving & set(files)
    assert all((root / f).is_file() for f in [*files, *serving])


def test_compact_index_ratio():
    index, n_src = compact_index(3 * 1536, "cpu")
    assert index.shape == (3 * 1536,) and n_src == 3 * 768
    assert torch.equal(torch.unique(index), torch.arange(n_src, dtype=torch.int32))
