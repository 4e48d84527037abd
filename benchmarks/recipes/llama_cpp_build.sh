#!/usr/bin/env bash
# docs/performance/cpu.md, "Against llama.cpp": build llama.cpp's llama-server from the llama.cpp
# that the llama-cpp-python 0.3.36 sdist vendors, and convert the 28-layer Qwen3-0.6B-shaped
# fixture to GGUF (F32 and Q8_0) with llama.cpp's own converter, in a venv of its own.
#
#   benchmarks/recipes/llama_cpp_build.sh WORK_DIR [MODEL_DIR] [CONVERTER_VENV]
#
# Run from the repo root with radixserve's venv active (it builds the fixture). Defaults:
# MODEL_DIR /tmp/q06b28, CONVERTER_VENV WORK_DIR/convert-venv. Leaves WORK_DIR/llama_cpp_python-0.3.36/
# build/bin/llama-server and MODEL_DIR-f32.gguf, MODEL_DIR-q8_0.gguf. Needs cmake, a C++ compiler and
# PyPI; the build takes about 7 minutes on a quiet 2-core machine (~35 on 2 cores shared with
# other jobs). Every step runs in WORK_DIR/llama_cpp_python-0.3.36 after the `cd` below. (LLAMA_CURL is deprecated in this llama.cpp
# and only warns; nothing is downloaded at run time.)
set -euo pipefail
work=$1 model=${2:-/tmp/q06b28}
mkdir -p "$work"; work=$(cd "$work" && pwd); venv=${3:-$work/convert-venv}
[ -f "$model/config.json" ] || python -m fixtures "$model" --preset qwen3-0.6b   # 28 layers, float32
cd "$work"
pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36
tar xzf llama_cpp_python-0.3.36.tar.gz && cd llama_cpp_python-0.3.36
cmake -B build vendor/llama.cpp -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release
cmake --build build -j2 --target llama-server       # build/bin/llama-server
python -m venv "$venv" && . "$venv/bin/activate"   # the converter's own venv
# torch from the CPU wheel index, pinned first: unpinned, pip takes the CUDA build (~3 GB of packages)
pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# requirements/requirements-convert_hf_to_gguf.txt
pip install "numpy~=2.2.6" "sentencepiece>=0.1.98,<0.3.0" "transformers==4.57.6" "protobuf>=4.21.0,<5.0.0" \
    torch==2.13.0 ./vendor/llama.cpp/gguf-py
python vendor/llama.cpp/convert_hf_to_gguf.py "$model" --outtype f32  --outfile "$model-f32.gguf"
python vendor/llama.cpp/convert_hf_to_gguf.py "$model" --outtype q8_0 --outfile "$model-q8_0.gguf"
