# syntax=docker/dockerfile:1.7
# radixserve images. The flags of `radixserve` pass straight through `docker run IMAGE ...`.
#
#   docker build -t radixserve .                                  # GPU (default, last stage)
#   docker build --target cpu -t radixserve:cpu .                 # CPU only, python:3.11-slim
#   docker build --build-arg WITH_FLASH_ATTN=1 -t radixserve:fa . # GPU + flash-attn (slow build)
#   podman build --format docker --target cpu -t radixserve:cpu . # podman/buildah: see the NOTE
#
# NOTE: podman and buildah write OCI images by default, and the OCI format has no HEALTHCHECK (it
# is dropped with a warning): build with `--format docker` to keep it. Base images are named in
# full (docker.io/...) because podman resolves no short names without a configured registry.
# NOTE: TORCH_INDEX_URL is the wheel index torch comes from (default: the PyTorch index of the
# stage, .../whl/cpu or .../whl/${TORCH_CUDA}). Behind a mirror or proxy pass its URL; an empty
# value (`--build-arg TORCH_INDEX_URL=`) leaves the index to pip's own configuration (pip.conf,
# PIP_INDEX_URL, PIP_FIND_LINKS), whose torch must then be the right build.
#
# GPU pair: torch ${TORCH_VERSION} from the PyTorch ${TORCH_CUDA} wheel index on an
# nvidia/cuda ${CUDA_VERSION} base. The devel stage compiles the CUDA kernels (kernels/*.cu) for
# TORCH_CUDA_ARCH_LIST into TORCH_EXTENSIONS_DIR; the gpu stage copies the venv and that
# directory onto the CUDA *base* image, so no compiler runs when a container starts.
# NOTE: torch, CUDA base and wheel index move together; override all three, e.g.
#   --build-arg TORCH_CUDA=cu130 --build-arg CUDA_VERSION=13.0.0
# NOTE: TORCH_VERSION must match the pin in .ci/run (tests/test_deploy.py checks it).

ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA=cu128
ARG CUDA_VERSION=12.8.1
ARG UBUNTU_VERSION=24.04

# ---------------------------------------------------------------------------------------------
# Stage 1: CUDA devel. Python venv with torch + the project; the kernels built once, here.
FROM docker.io/nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS cuda-build
ARG TORCH_VERSION
ARG TORCH_CUDA
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_CUDA}
ARG WITH_FLASH_ATTN=0
ARG FLASH_ATTN_VERSION=2.8.3
# flash-attn compile: its own arch list and a cap on parallel compiler jobs. This is
# FlashAttention-2: the same kernels for every arch, none Hopper-specific (the TMA/WGMMA kernels
# are FlashAttention-3, flash-attn's separate hopper/ build, not installed here). sm_80 code runs
# on 8.6/8.9 too; 9.0 is listed because compiled code does not carry across major versions: an
# H100 runs FA2's Ampere-design kernels compiled for sm_90. Each nvcc job
# of flash-attn takes several GB of RAM (x NVCC_THREADS), so uncapped ninja on a many-core
# builder runs out of memory. See docs/operations.md ("Kernels, flash-attn and ninja").
ARG FLASH_ATTN_CUDA_ARCHS="80;90"
ARG MAX_JOBS=4
ARG NVCC_THREADS=2

# NOTE: 9.0+PTX also embeds PTX for compute_90, which the driver compiles at first load on a
# GPU newer than every listed arch (Blackwell: 10.0, 12.0), so the gather kernel still runs there
# instead of failing with "no kernel image is available".
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    CUDA_HOME=/usr/local/cuda \
    TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0+PTX" \
    TORCH_EXTENSIONS_DIR=/opt/radixserve/torch_extensions

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && python -m pip install --upgrade pip

# torch first, from the CUDA wheel index (a plain `pip install torch` picks whatever CUDA PyPI has).
RUN python -m pip install torch==${TORCH_VERSION} ${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"} \
    && python -m pip install ninja packaging wheel

# Optional flash-attn stage, compiled against the torch above with ninja (installed above):
# only FLASH_ATTN_CUDA_ARCHS, at most MAX_JOBS compiler jobs of NVCC_THREADS threads each.
RUN if [ "${WITH_FLASH_ATTN}" = "1" ]; then \
        FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" MAX_JOBS=${MAX_JOBS} NVCC_THREADS=${NVCC_THREADS} \
        python -m pip install flash-attn==${FLASH_ATTN_VERSION} --no-build-isolation \
        && python -c "import flash_attn, flash_attn_2_cuda; print('flash-attn', flash_attn.__version__)"; \
    fi

WORKDIR /src
COPY pyproject.toml README.md ./
COPY server ./server
COPY scheduler ./scheduler
COPY models ./models
COPY kernels ./kernels
COPY loadtest ./loadtest
RUN python -m pip install .

# Build the CUDA extensions for every arch in TORCH_CUDA_ARCH_LIST (no GPU needed to compile).
# NOTE: run from / so the *installed* package is imported: the build records source paths, and
# they must be the site-packages ones the runtime image sees, not /src.
RUN cd / && python -m kernels.build && ls -lR "${TORCH_EXTENSIONS_DIR}"

# ---------------------------------------------------------------------------------------------
# Stage 2 (target `cpu`): CPU only, the same install commands as .ci/run (torch pin, then .).
FROM docker.io/library/python:3.11-slim AS cpu
ARG TORCH_VERSION
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/data \
    HOSTNAME=0.0.0.0 \
    RADIXSERVE_DISABLE_KERNELS=1

# NOTE: HOSTNAME is the env twin of --hostname, and Docker sets it to the container id, which
# would bind the server to the container's address only (the HEALTHCHECK on 127.0.0.1 fails).
# An image ENV wins over Docker's value, so pin it; `-e HOSTNAME=...` still overrides.
# The CPU wheel index: the PyPI torch for Linux drags in gigabytes of CUDA libraries.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libjemalloc2 \
    && rm -rf /var/lib/apt/lists/* \
    && python -m pip install torch==${TORCH_VERSION} ${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"}

# The project's dependencies from pyproject.toml alone, in a layer of their own: a change to the
# sources (or the README) rebuilds only the `--no-deps` install below, which takes seconds.
WORKDIR /src
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && python -m pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt \
    && useradd --create-home --uid 10001 radixserve \
    && mkdir -p /data && chown radixserve:radixserve /data
COPY README.md ./
COPY server ./server
COPY scheduler ./scheduler
COPY models ./models
COPY kernels ./kernels
COPY loadtest ./loadtest
# NOTE: the in-tree build leaves build/ and radixserve.egg-info in /src; removed in the same layer.
RUN python -m pip install --no-deps . && rm -rf build ./*.egg-info

# Memory: jemalloc instead of glibc's malloc for every process in the container (the bare
# soname resolves on any architecture): under a churning load it settles where glibc keeps
# growing. MALLOC_CONF: jemalloc's default purges allocations over 8 MiB (a batch's activations)
# at once, so every op of a big forward faulted fresh pages in (0.90x glibc's items/s at full
# load); oversize_threshold:0 keeps them under the normal 10 s decay (1.35x glibc's), and
# background_thread:true returns idle pages without waiting for the next allocation
# (docs/decisions.md, "jemalloc and capped oneDNN caches"). The two capacities bound the per-shape
# primitive caches of the packed CPU linears (torch's ideep LRU and oneDNN's own, 1024 entries each
# by default), which otherwise grow by hundreds of MB when batch shapes vary (docs/operations.md,
# "Memory (RSS) on the CPU"). `-e LD_PRELOAD=` turns jemalloc off.
ENV LD_PRELOAD=libjemalloc.so.2 \
    MALLOC_CONF=oversize_threshold:0,background_thread:true \
    LRU_CACHE_CAPACITY=64 \
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=64

USER radixserve
WORKDIR /home/radixserve
VOLUME ["/data"]
EXPOSE 8080
# PORT is the env twin of --port; the check follows it. The start period covers a cold download
# of the model into /data (30 min: 16 GB, an 8B model in bf16, at ~10 MB/s); the first passing
# check ends it early, so a warm start is healthy within one interval. To start without the
# download, fill the volume first (docs/operations.md, "Pre-downloading the model").
HEALTHCHECK --interval=15s --timeout=5s --start-period=1800s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PORT', '8080'), timeout=4)"
ENTRYPOINT ["radixserve"]

# ---------------------------------------------------------------------------------------------
# Stage 3 (default target `gpu`): CUDA base image, the venv and the prebuilt kernels.
# NOTE: the *base* image (CUDA runtime library, the forward-compatibility package and the NVIDIA
# container toolkit settings), not *runtime* or *cudnn-runtime*: torch's CUDA wheel brings its own
# CUDA libraries as nvidia-* packages in the venv (cuBLAS, cuDNN, cuFFT, cuRAND, cuSOLVER,
# cuSPARSE(Lt), NCCL, NVRTC, nvJitLink, the CUDA runtime, CUPTI) and loads those, never the
# system copies. The runtime image's layers over base are those same libraries again (plus NPP
# and nvJPEG, unused): for torch 2.13.0 on PyPI the wheels of the duplicated ones weigh about
# 1.3 GB compressed (cuBLAS 404 MB, cuFFT 204 MB, NCCL 196 MB, cuSOLVER 192 MB, cuSPARSE 139 MB,
# NVRTC 86 MB, cuRAND 57 MB, nvJitLink 44 MB), and cudnn-runtime adds cuDNN (349 MB) once more.
# The image is the base, Python and the venv (wheels: torch 502 MB, triton 189 MB, nvidia-*
# about 1.9 GB): roughly 1.3 GB (runtime) to 1.7 GB (cudnn-runtime) smaller compressed. These
# figures are estimates from the PyPI wheel sizes, not from built images.
FROM docker.io/nvidia/cuda:${CUDA_VERSION}-base-ubuntu${UBUNTU_VERSION} AS gpu

# NOTE: the gather kernel is imported straight from the prebuilt .so when its stamp (sources,
# torch, CUDA, TORCH_CUDA_ARCH_LIST, flags; kernels/build.py) matches and a self-test gather on
# the GPU passes; this stage has no nvcc, so a mismatch means the pure-torch fallback with a
# WARNING. TORCH_CUDA_ARCH_LIST and CUDA_HOME mirror the build stage (they are in the stamp).
# The kernel is opt-in (-e RADIXSERVE_GATHER_IMPL=cuda) until measured on a GPU; see kernels/__init__.py.
# PYTORCH_CUDA_ALLOC_CONF: expandable segments let the caching allocator grow a segment in place
# instead of stranding blocks between batches of changing shape (fewer OOMs at the same
# --max-batch-tokens); `-e PYTORCH_CUDA_ALLOC_CONF=...` overrides it.
ENV DEBIAN_FRONTEND=noninteractive \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    CUDA_HOME=/usr/local/cuda \
    TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0+PTX" \
    TORCH_EXTENSIONS_DIR=/opt/radixserve/torch_extensions \
    HF_HOME=/data \
    HOSTNAME=0.0.0.0 \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

# Same Ubuntu as the build stage, so the venv's python3 symlink resolves to the same interpreter.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 ca-certificates libjemalloc2 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 radixserve \
    && mkdir -p /data && chown radixserve:radixserve /data

COPY --from=cuda-build /opt/venv /opt/venv
COPY --from=cuda-build --chown=radixserve:radixserve /opt/radixserve/torch_extensions /opt/radixserve/torch_extensions

# Memory: jemalloc instead of glibc's malloc for every process in the container (the bare
# soname resolves on any architecture): under a churning load it settles where glibc keeps
# growing. MALLOC_CONF: jemalloc's default purges allocations over 8 MiB (a batch's activations)
# at once, so every op of a big forward faulted fresh pages in (0.90x glibc's items/s at full
# load); oversize_threshold:0 keeps them under the normal 10 s decay (1.35x glibc's), and
# background_thread:true returns idle pages without waiting for the next allocation
# (docs/decisions.md, "jemalloc and capped oneDNN caches"). The two capacities bound the per-shape
# primitive caches of the packed CPU linears (torch's ideep LRU and oneDNN's own, 1024 entries each
# by default), which otherwise grow by hundreds of MB when batch shapes vary (docs/operations.md,
# "Memory (RSS) on the CPU"). `-e LD_PRELOAD=` turns jemalloc off.
ENV LD_PRELOAD=libjemalloc.so.2 \
    MALLOC_CONF=oversize_threshold:0,background_thread:true \
    LRU_CACHE_CAPACITY=64 \
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=64

USER radixserve
WORKDIR /home/radixserve
VOLUME ["/data"]
EXPOSE 8080
# Start period: as in the cpu stage (a cold 16 GB download; or pre-download, docs/operations.md).
HEALTHCHECK --interval=15s --timeout=5s --start-period=1800s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PORT', '8080'), timeout=4)"
ENTRYPOINT ["radixserve"]
