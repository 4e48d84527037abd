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
    assert stages["cuda-build"]["base"].startswith("docker.io/nvidia/cuda:") and "-devel-" in stages["cuda-build"]["base"]
    # The CUDA *base* image: torch's wheel ships the CUDA libraries the runtime image would duplicate.
    assert stages["gpu"]["base"].startswith("docker.io/nvidia/cuda:") and "-base-" in stages["gpu"]["base"]
    assert stages["cpu"]["base"] == "docker.io/library/python:3.11-slim"
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
    project_step = next(i for i, r in enumerate(runs) if re.search(r"pip install (--no-deps )?\.(\s|$)", r))
    assert torch_step < project_step
    assert args_of(stages["cpu"])["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
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


# --- what podman/buildah and mirrors need (issue: the image built and run in CI) -------------

def test_base_images_are_fully_qualified(stages):
    """podman resolves no short name (`nvidia/cuda:...`) without a configured search registry."""
    for stage in stages["__order__"]:
        registry = stage["base"].split("/")[0]
        assert "." in registry or ":" in registry or registry == "localhost", stage["base"]


@pytest.mark.parametrize("target, index", [("cpu", "https://download.pytorch.org/whl/cpu"),
                                           ("cuda-build", "https://download.pytorch.org/whl/${TORCH_CUDA}")])
def test_torch_wheel_index_is_a_build_argument(stages, target, index):
    """A mirror or proxy passes TORCH_INDEX_URL; empty leaves the index to pip's configuration."""
    stage = stages[target]
    args = args_of(stage)
    assert args["TORCH_INDEX_URL"] == index
    if "${TORCH_CUDA}" in index:  # declared in the stage before the default that uses it
        names = [a.partition("=")[0] for k, a in stage["instrs"] if k == "ARG"]
        assert names.index("TORCH_CUDA") < names.index("TORCH_INDEX_URL")
    runs = [a for k, a in stage["instrs"] if k == "RUN" and "torch==${TORCH_VERSION}" in a]
    assert len(runs) == 1
    assert '${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"}' in runs[0], runs[0]
    assert "download.pytorch.org" not in runs[0]  # no index hard-coded past the argument
    text = (ROOT / "Dockerfile").read_text()
    assert "--build-arg TORCH_INDEX_URL=" in text


def test_header_says_to_keep_healthcheck_with_the_docker_format():
    lines = (ROOT / "Dockerfile").read_text().split("\nARG ", 1)[0].splitlines()
    header = " ".join(line.lstrip("# ") for line in lines if line.startswith("#"))
    assert "--format docker" in header and "HEALTHCHECK" in header and "OCI" in header, header
    ops = (ROOT / "docs" / "operations.md").read_text()
    assert "--format docker" in ops


def test_cpu_stage_leaves_no_build_debris_in_src(stages):
    """The in-tree build writes build/ and *.egg-info into /src: removed in the same layer."""
    runs = [a for k, a in stages["cpu"]["instrs"] if k == "RUN" and re.search(r"pip install (--no-deps )?\.", a)]
    assert len(runs) == 1 and "rm -rf build ./*.egg-info" in runs[0], runs


def test_cpu_stage_installs_dependencies_before_the_sources_arrive(stages):
    """Layer cache: a source change reruns only the `--no-deps` install; the dependencies' layer
    depends on pyproject.toml alone."""
    instrs = stages["cpu"]["instrs"]
    deps = next(i for i, (k, a) in enumerate(instrs) if k == "RUN" and "requirements.txt" in a)
    copies = [(i, a) for i, (k, a) in enumerate(instrs) if k == "COPY"]
    before = [a.split()[:-1] for i, a in copies if i < deps]
    assert before == [["pyproject.toml"]], before
    project = next(i for i, (k, a) in enumerate(instrs) if k == "RUN" and "pip install --no-deps ." in a)
    for package in ("server", "scheduler", "models", "kernels", "loadtest"):
        at = next(i for i, a in copies if a.split()[0] == package)
        assert deps < at < project, package


def test_dockerignore_keeps_build_debris_and_venvs_out():
    patterns = {p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", "build", "dist", "**/__pycache__"} <= patterns
    assert "*.egg-info" in patterns and "**/*.egg-info" in patterns


# --- GPU stages: what can be checked without the CUDA base images --------------------------------

def test_cuda_version_matches_the_torch_cuda_wheel_tag(stages):
    """TORCH_CUDA=cuXY needs a CUDA X.Y base (the pairs move together, the header says)."""
    glob = {k: (v or "").strip('"') for k, v in args_of(stages["__global__"]).items()}
    tag = re.fullmatch(r"cu(\d+)(\d)", glob["TORCH_CUDA"])
    assert tag, glob["TORCH_CUDA"]
    major, minor = glob["CUDA_VERSION"].split(".")[:2]
    assert (tag.group(1), tag.group(2)) == (major, minor), (glob["TORCH_CUDA"], glob["CUDA_VERSION"])
    for stage in ("cuda-build", "gpu"):
        assert "${CUDA_VERSION}" in stages[stage]["base"] and "${UBUNTU_VERSION}" in stages[stage]["base"]
    # every ${ARG} a stage uses is declared for it (globals only reach FROM lines)
    for name in ("cuda-build", "cpu", "gpu"):
        declared = set(args_of(stages[name])) | {k for k, _ in env_of(stages[name]).items()}
        for keyword, arg in stages[name]["instrs"]:
            if keyword in ("RUN", "ENV"):
                for used in re.findall(r"\$\{(\w+)", arg):
                    assert used in declared or used == "PATH", (name, used)


def test_gpu_runtime_stage_gets_what_the_kernels_load(stages):
    """kernels.build loads a prebuilt library only when its stamp matches: the sources (installed
    as package data into the venv the gpu stage copies), torch, CUDA_HOME and the arch list."""
    import tomllib

    from kernels.build import EXTENSIONS

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kernels"]
    for ext in EXTENSIONS:
        for source in ext.sources:
            assert source.parent.name == "kernels" and any(fnmatch(source.name, p) for p in data), source
    build, gpu = stages["cuda-build"], stages["gpu"]
    venv = env_of(build)["VIRTUAL_ENV"]
    assert env_of(gpu)["VIRTUAL_ENV"] == venv and env_of(gpu)["PATH"].startswith(f"{venv}/bin:")
    runs = [a for k, a in build["instrs"] if k == "RUN"]
    install = next(i for i, r in enumerate(runs) if re.search(r"pip install \.(\s|$)", r))
    kernel = next(i for i, r in enumerate(runs) if "kernels.build" in r)
    assert install < kernel and runs[kernel].startswith("cd / &&")  # the installed sources, not /src
    copies = {a.split()[-1]: a for k, a in gpu["instrs"] if k == "COPY"}
    assert "--chown=radixserve" in copies[env_of(build)["TORCH_EXTENSIONS_DIR"]]  # the loader may rebuild there
    gpu_runs = " ".join(a for k, a in gpu["instrs"] if k == "RUN")
    assert "python3" in gpu_runs  # the venv's interpreter symlink points at the system python3
