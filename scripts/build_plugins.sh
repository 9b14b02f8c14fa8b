#!/usr/bin/env bash
# Configure and build the P-EAGLE CUDA kernels (and the TensorRT plugins when TensorRT is found)
# into plugins/build (Release). Needs cmake >= 3.24 and nvcc (CUDA 12.8+; 13.0 here); no GPU needed.
# Without cmake (or with PEAGLE_BUILD_WITH=nvcc) it builds libpeagle_kernels.so alone with one nvcc command.
#   scripts/build_plugins.sh                      # sm_90a + sm_100a SASS, compute_90 PTX
#   TENSORRT_ROOT=/opt/tensorrt scripts/build_plugins.sh
#   PEAGLE_CUDA_ARCHITECTURES="90a-real" scripts/build_plugins.sh    # faster, Hopper only
#   PEAGLE_WERROR=OFF scripts/build_plugins.sh    # warnings of our sources stay warnings (default: errors)
# Extra arguments go to the configure step (e.g. -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${PEAGLE_PLUGINS_BUILD_DIR:-plugins/build}"
NVCC="${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
if [ ! -x "$NVCC" ]; then
    echo "build_plugins.sh: nvcc not found (set CUDACXX or put nvcc on PATH)" >&2
    exit 2
fi
# passed on every configure, so a build directory never keeps an older architecture list
ARCHS="${PEAGLE_CUDA_ARCHITECTURES:-90a-real;100a-real;90-virtual}"
WERROR="${PEAGLE_WERROR:-ON}"
if [ "${PEAGLE_BUILD_WITH:-cmake}" = nvcc ] || ! command -v cmake >/dev/null 2>&1; then
    # no CMake (e.g. a bare GPU machine): the kernel library alone, straight from nvcc
    echo "build_plugins.sh: building libpeagle_kernels.so with nvcc only (no cmake: no TensorRT plugins)" >&2
    gencode=()
    IFS=';' read -ra list <<< "$ARCHS"
    for a in "${list[@]}"; do
        case "$a" in
            *-real) gencode+=(-gencode "arch=compute_${a%-real},code=sm_${a%-real}") ;;
            *-virtual) gencode+=(-gencode "arch=compute_${a%-virtual},code=compute_${a%-virtual}") ;;
            *) gencode+=(-gencode "arch=compute_${a},code=[sm_${a},compute_${a}]") ;;
        esac
    done
    werror=()
    xwerror=""
    if [ "$WERROR" = ON ]; then werror=(--Werror=all-warnings); xwerror=",-Werror"; fi
    mkdir -p "$BUILD_DIR"
    "$NVCC" -O3 -std=c++17 -shared -cudart static -lineinfo "${werror[@]}" \
        -Xcompiler "-fPIC,-fvisibility=hidden,-Wall,-Wextra$xwerror" \
        -Iplugins/include "${gencode[@]}" plugins/src/kernels/*.cu -o "$BUILD_DIR/libpeagle_kernels.so"
    echo "build_plugins.sh: built $BUILD_DIR/libpeagle_kernels.so"
    exit 0
fi
args=(-S plugins -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$NVCC"
      -DPEAGLE_CUDA_ARCHITECTURES="$ARCHS" -DPEAGLE_WERROR="$WERROR")
if [ -n "${TENSORRT_ROOT:-}" ]; then
    args+=(-DTENSORRT_ROOT="$TENSORRT_ROOT")
fi
cmake "${args[@]}" "$@"
cmake --build "$BUILD_DIR" --parallel "${PEAGLE_BUILD_JOBS:-$(nproc)}"
echo "build_plugins.sh: built $(ls "$BUILD_DIR"/libpeagle_*.so | tr '\n' ' ')"
