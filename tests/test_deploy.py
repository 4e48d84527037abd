"""Shipping files, part 1: the Dockerfile and .dockerignore.

No Docker engine runs here, so these tests check what can be checked statically: every promised
property of the Dockerfile and that the CPU image installs the same torch as CI. The compose
stack, Prometheus, Grafana and Kubernetes are in tests/test_deploy_stack.py.
"""
from __future__ import annotations

import json
import re
import shlex
from fnmatch import fnmatch
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
ARCHS = "8.0;8.6;8.9;9.0+PTX"


# --- Dockerfile --------------------------------------------------------------------------------

def dockerfile_stages(text: str) -> list[dict]:
    """Instructions per stage: [{name, base, instrs: [(KEYWORD, args)]}]; ARGs before FROM in stage -1."""
    lines, buf = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue  # comment lines inside a continuation are dropped by Docker too
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        lines.append(buf + stripped)
        buf = ""
    stages = [{"name": None, "base": None, "instrs": []}]
    for line in lines:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append({"name": name, "base": parts[0], "instrs": []})
        stages[-1]["instrs"].append((keyword, args.strip()))
    return stages


def env_of(stage: dict) -> dict[str, str]:
    out = {}
    for keyword, args in stage["instrs"]:
        if keyword == "ENV":
            for token in shlex.split(args):
                key, _, value = token.partition("=")
                out[key] = value
    return out


def args_of(stage: dict) -> dict[str, str | None]:
    out = {}
    for keyword, args in stage["instrs"]:
        if keyword == "ARG":
            key, sep, value = args.partition("=")
            out[key] = value if sep else None
    return out


@pytest.fixture(scope="module")
def stages():
    parsed = dockerfile_stages((ROOT / "Dockerfile").read_text())
    return {s["name"]: s for s in parsed[1:]} | {"__global__": parsed[0], "__order__": parsed[1:]}


def test_dockerfile_stages_and_default_target(stages):
    order = [s["name"] for s in stages["__order__"]]
    assert set(order) == {"cuda-build", "cpu", "gpu"}
    assert order[-1] == "gpu", "the default target (last stage) must be the GPU image"
    assert stages["cuda-build"]["base"].startswith("nvidia/cuda:") and "-devel-" in stages["cuda-build"]["base"]
    # The CUDA *base* image: torch's wheel ships the CUDA libraries the runtime image would duplicate.
    assert stages["gpu"]["base"].startswith("nvidia/cuda:") and "-base-" in stages["gpu"]["base"]
    assert stages["cpu"]["base"] == "python:3.11-slim"
    # Devel and base images come from the same CUDA/Ubuntu args, so the venv's python matches.
    assert stages["cuda-build"]["base"].replace("-devel-", "-base-") == stages["gpu"]["base"]


# NOTE: ids must not be "gpu": conftest skips every item carrying a "gpu" keyword without CUDA.
@pytest.mark.parametrize("target", ["gpu", "cpu"], ids=["gpu-target", "cpu-target"])
def test_final_images_promises(stages, target):
    stage = stages[target]
    instrs = stage["instrs"]
    users = [a for k, a in instrs if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    entry = [a for k, a in instrs if k == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["radixserve"]
    assert not [a for k, a in instrs if k == "CMD"], "flags must pass straight through to radixserve"
    checks = [a for k, a in instrs if k == "HEALTHCHECK"]
    assert checks and "/health" in checks[-1] and "8080" in checks[-1]
    env = env_of(stage)
    assert env["HF_HOME"] == "/data"
    assert env["HOSTNAME"] == "0.0.0.0"
    volumes = [a for k, a in instrs if k == "VOLUME"]
    assert volumes and "/data" in volumes[-1]
    assert any(k == "EXPOSE" and a == "8080" for k, a in instrs)


def test_kernels_prebuilt_in_devel_and_copied(stages):
    build, gpu = stages["cuda-build"], stages["gpu"]
    assert env_of(build)["TORCH_CUDA_ARCH_LIST"] == ARCHS
    ext_dir = env_of(build)["TORCH_EXTENSIONS_DIR"]
    # Identical build flags at run time, else the extension loader wants to recompile.
    for key in ("TORCH_CUDA_ARCH_LIST", "TORCH_EXTENSIONS_DIR", "CUDA_HOME"):
        assert env_of(gpu)[key] == env_of(build)[key]
    runs = [a for k, a in build["instrs"] if k == "RUN"]
    assert any("kernels.build" in r for r in runs)
    copies = [a for k, a in gpu["instrs"] if k == "COPY"]
    assert any("--from=cuda-build" in c and c.split()[-1] == ext_dir for c in copies)
    assert any("--from=cuda-build" in c and c.split()[-1] == "/opt/venv" for c in copies)


def test_kernel_build_step_names_a_real_module(stages):
    """The devel stage's `python -m MODULE` build step must exist while kernels/ ships .cu files."""
    import importlib.util

    runs = [a for k, a in stages["cuda-build"]["instrs"] if k == "RUN" and "kernels." in a]
    modules = [m for r in runs for m in re.findall(r"python -m (kernels\.\w+)", r)]
    assert modules, "no kernel build step in the cuda-build stage"
    if not list((ROOT / "kernels").glob("*.cu")):
        pytest.skip("kernels/ ships no CUDA sources")
    for module in modules:
        assert importlib.util.find_spec(module) is not None, f"Dockerfile runs `python -m {module}`: missing"


def test_flash_attn_build_arg(stages):
    build = stages["cuda-build"]
    assert args_of(build)["WITH_FLASH_ATTN"] == "0"
    runs = [a for k, a in build["instrs"] if k == "RUN"]
    assert any("${WITH_FLASH_ATTN}" in r and "flash-attn" in r for r in runs)


def test_flash_attn_stage_has_arch_list_and_job_cap(stages):
    """flash-attn compiles only for named archs (a subset of the kernels' list), with ninja and
    a bounded number of compiler jobs: uncapped, it needs tens of GB of RAM."""
    build = stages["cuda-build"]
    args = {k: (v or "").strip('"') for k, v in args_of(build).items()}
    flash_archs = args["FLASH_ATTN_CUDA_ARCHS"].split(";")
    torch_archs = {a.removesuffix("+PTX").replace(".", "") for a in env_of(build)["TORCH_CUDA_ARCH_LIST"].split(";")}
    assert flash_archs and set(flash_archs) <= torch_archs, (flash_archs, torch_archs)
    assert 1 <= int(args["MAX_JOBS"]) <= 8 and 1 <= int(args["NVCC_THREADS"]) <= 4
    runs = [a for k, a in build["instrs"] if k == "RUN"]
    flash = [i for i, r in enumerate(runs) if "flash-attn==" in r]
    assert len(flash) == 1
    run = runs[flash[0]]
    for var in ("FLASH_ATTN_CUDA_ARCHS", "MAX_JOBS", "NVCC_THREADS"):
        assert f"{var}=" in run and "${" + var + "}" in run, var
    assert "--no-build-isolation" in run and "import flash_attn" in run  # fails the build, not a start
    assert any("ninja" in r for r in runs[:flash[0]])  # without ninja the build is serial, hours


def _comment_before(text: str, marker: str) -> str:
    """The comment lines right above the first line containing ``marker``."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if marker in line)
    block = []
    for line in reversed(lines[:at]):
        if not line.startswith("#"):
            break
        block.append(line.lstrip("# "))
    return " ".join(reversed(block))


def test_gpu_image_is_the_cuda_base_with_its_size_reasoning(stages):
    """No second copy of cuBLAS & co.: the comment says why, in gigabytes."""
    assert "-runtime-" not in stages["gpu"]["base"] and "cudnn" not in stages["gpu"]["base"]
    why = _comment_before((ROOT / "Dockerfile").read_text(), " AS gpu")
    assert "nvidia-*" in why and "cuBLAS" in why and re.search(r"\d(\.\d)? GB", why), why


def test_arch_list_carries_ptx_of_the_newest_arch(stages):
    """A GPU newer than every listed arch JIT-compiles the embedded PTX instead of finding no kernel."""
    archs = env_of(stages["cuda-build"])["TORCH_CUDA_ARCH_LIST"].split(";")
    assert archs[-1].endswith("+PTX"), archs
    numbers = [float(a.removesuffix("+PTX")) for a in archs]
    assert numbers[-1] == max(numbers) and sum(a.endswith("+PTX") for a in archs) == 1


def test_gpu_image_sets_expandable_segments(stages):
    conf = env_of(stages["gpu"]).get("PYTORCH_CUDA_ALLOC_CONF", "")
    assert "expandable_segments:True" in conf.split(","), conf


def _seconds(duration: str) -> float:
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(h|m|s|ms)", duration):
        total += float(number) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}[unit]
    return total


@pytest.mark.parametrize("target", ["gpu", "cpu"], ids=["gpu-target", "cpu-target"])
def test_healthcheck_start_period_covers_a_cold_16gb_download(stages, target):
    """16 GB (an 8B model in bf16) at 10 MB/s is 1600 s; the check must not kill the download."""
    check = next(a for k, a in stages[target]["instrs"] if k == "HEALTHCHECK")
    period = re.search(r"--start-period=(\S+)", check)
    assert period and _seconds(period.group(1)) >= 16e9 / 10e6, check
    ops = (ROOT / "docs" / "operations.md").read_text()
    assert "Pre-downloading the model" in ops  # the other way: fill the volume before starting


@pytest.mark.parametrize("target", ["gpu", "cpu"], ids=["gpu-target", "cpu-target"])
def test_final_images_preload_jemalloc_they_install_and_cap_onednn_caches(stages, target):
    """glibc's malloc keeps growing under churn where jemalloc settles, and the per-shape primitive
    caches of oneDNN hold hundreds of MB at their default size (docs/decisions.md, "jemalloc ...")."""
    instrs = stages[target]["instrs"]
    preload = [i for i, (k, a) in enumerate(instrs) if k == "ENV" and "LD_PRELOAD" in a]
    assert preload and env_of(stages[target])["LD_PRELOAD"] == "libjemalloc.so.2"
    installs = [i for i, (k, a) in enumerate(instrs) if k == "RUN" and re.search(r"apt-get install .*libjemalloc2", a)]
    assert installs and installs[0] < preload[0]  # installed before any later RUN runs under the preload
    # tests/test_allocator.py runs the server under this exact preload
    env = env_of(stages[target])
    for cache in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):  # oneDNN's per-shape caches
        assert 1 <= int(env[cache]) < 1024, (cache, env.get(cache))  # below the 1024 default


def test_flash_attn_comment_does_not_promise_hopper_kernels():
    """flash-attn 2 builds the same kernels for sm_90; Hopper's (TMA/WGMMA) are FlashAttention-3."""
    why = _comment_before((ROOT / "Dockerfile").read_text(), "ARG FLASH_ATTN_CUDA_ARCHS")
    assert "FlashAttention-2" in why and "FlashAttention-3" in why, why
    assert not re.search(r"9\.0 gets Hopper", why), why


def _torch_pin(text: str) -> str:
    pins = set(re.findall(r"\btorch==([0-9][\w.+]*)", text))
    assert len(pins) == 1, pins
    return pins.pop()


def test_cpu_image_installs_like_ci(stages):
    """Same torch pin as .ci/run, installed before the project, then the project itself."""
    ci = (ROOT / ".ci" / "run").read_text()
    ci_pin = _torch_pin(ci)
    assert stages["__global__"]["instrs"] and args_of(stages["__global__"])["TORCH_VERSION"] == ci_pin
    runs = [a for k, a in stages["cpu"]["instrs"] if k == "RUN"]
    torch_step = next(i for i, r in enumerate(runs) if "torch==${TORCH_VERSION}" in r)
    project_step = next(i for i, r in enumerate(runs) if re.search(r"pip install \.(\s|$)", r))
    assert torch_step < project_step
    assert "whl/cpu" in runs[torch_step]
    # the pinned torch, then the project (optional extras such as Ray may follow, best-effort)
    ci_steps = [s for s in re.findall(r"pip install (.+)", ci) if not s.startswith("-q ")]
    assert ci_steps[-2].startswith("torch==") and ci_steps[-1].startswith("-e ")


def test_dockerignore_keeps_what_the_build_copies():
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [p for p in patterns if p and not p.startswith("#")]

    def ignored(path: str) -> bool:
        parts = Path(path).parts
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        for p in patterns:
            if p.startswith("**/") and any(fnmatch(part, p[3:]) for part in parts):
                return True
            if any(fnmatch(pre, p) for pre in prefixes):
                return True
        return False

    copied = []
    for keyword, args in (s for st in dockerfile_stages((ROOT / "Dockerfile").read_text()) for s in st["instrs"]):
        if keyword == "COPY" and "--from" not in args:
            copied += args.split()[:-1]
    assert copied
    for source in copied:
        assert (ROOT / source).exists(), source
        assert not ignored(source), source
    for package in ("server", "scheduler", "models", "kernels", "loadtest"):
        for f in (ROOT / package).rglob("*"):
            if f.is_file() and f.suffix in (".py", ".cu", ".cpp"):
                assert not ignored(str(f.relative_to(ROOT))), f
    for heavy in (".git", "tests", "deploy/grafana", "x/__pycache__/a.pyc"):
        assert ignored(heavy), heavy
