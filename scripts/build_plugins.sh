#!/usr/bin/env bash
# Configure and build the P-EAGLE CUDA kernels (and the TensorRT plugins when TensorRT is found)
# into plugins/build (Release). Needs cmake >= 3.24 and nvcc (CUDA 12.8+; 13.0 here); no GPU needed.
#   scripts/build_plugins.sh                      # sm_90a + sm_100a SASS, compute_90 PTX
#   TENSORRT_ROOT=/opt/tensorrt scripts/build_plugins.sh
#   PEAGLE_CUDA_ARCHITECTURES="90a-real" scripts/build_plugins.sh    # faster, Hopper only
# Extra arguments go to the configure step (e.g. -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${PEAGLE_PLUGINS_BUILD_DIR:-plugins/build}"
NVCC="${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
if [ ! -x "$NVCC" ]; then
    echo "build_plugins.sh: nvcc not found (set CUDACXX or put nvcc on PATH)" >&2
    exit 2
fi
args=(-S plugins -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$NVCC")
if [ -n "${PEAGLE_CUDA_ARCHITECTURES:-}" ]; then
    args+=(-DCMAKE_CUDA_ARCHITECTURES="$PEAGLE_CUDA_ARCHITECTURES")
fi
if [ -n "${TENSORRT_ROOT:-}" ]; then
    args+=(-DTENSORRT_ROOT="$TENSORRT_ROOT")
fi
cmake "${args[@]}" "$@"
cmake --build "$BUILD_DIR" --parallel "${PEAGLE_BUILD_JOBS:-$(nproc)}"
echo "build_plugins.sh: built $(ls "$BUILD_DIR"/libpeagle_*.so | tr '\n' ' ')"
