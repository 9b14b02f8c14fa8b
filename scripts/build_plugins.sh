#!/usr/bin/env bash
# Build the P-EAGLE kernel library (and the TensorRT plugins when TensorRT is found) into plugins/build
# (Release). The kernels are the Triton kernels of peagle_trt/ops/triton_kernels, compiled ahead of
# time to sm_90a / sm_100a cubins by a Python with triton==3.9.0 ($PEAGLE_PYTHON, default python3) and
# embedded; the C++ sources need g++ and the CUDA toolkit's headers and static runtime. No GPU, no nvcc.
# Without cmake (or with PEAGLE_BUILD_WITH=gxx) it builds libpeagle_kernels.so alone with g++.
#   scripts/build_plugins.sh                      # sm_90a + sm_100a cubins
#   TENSORRT_ROOT=/opt/tensorrt scripts/build_plugins.sh
#   PEAGLE_TRITON_ARCHS="90" scripts/build_plugins.sh    # faster, Hopper only
#   PEAGLE_WERROR=OFF scripts/build_plugins.sh    # warnings of our sources stay warnings (default: errors)
# Extra arguments go to the configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${PEAGLE_PLUGINS_BUILD_DIR:-plugins/build}"
PYTHON="${PEAGLE_PYTHON:-python3}"
ARCHS="${PEAGLE_TRITON_ARCHS:-90;100}"
WERROR="${PEAGLE_WERROR:-ON}"
if ! "$PYTHON" -c 'import triton' 2>/dev/null; then
    echo "build_plugins.sh: $PYTHON cannot import triton (pip install -c constraints.txt -e '.[dev]', or set PEAGLE_PYTHON)" >&2
    exit 2
fi
if [ "${PEAGLE_BUILD_WITH:-cmake}" = gxx ] || ! command -v cmake >/dev/null 2>&1; then
    # no CMake (e.g. a bare GPU machine): the kernel library alone, straight from g++
    echo "build_plugins.sh: building libpeagle_kernels.so with g++ only (no cmake: no TensorRT plugins)" >&2
    CUDA="${CUDA_HOME:-/usr/local/cuda}"
    archs=()
    IFS=';' read -ra list <<< "$ARCHS"
    for a in "${list[@]}"; do archs+=(--arch "$a"); done
    mkdir -p "$BUILD_DIR/triton"
    PYTHONPATH="$PWD" TRITON_DEFAULT_FP_FUSION=1 TRITON_INTERPRET=0 "$PYTHON" -m peagle_trt.ops.triton_kernels.aot "$BUILD_DIR/triton" "${archs[@]}"
    werror=()
    if [ "$WERROR" = ON ]; then werror=(-Werror); fi
    g++ -O2 -std=c++17 -shared -fPIC -fvisibility=hidden -Wall -Wextra "${werror[@]}" \
        -Iplugins/include -Iplugins/src/launcher -isystem "$CUDA/include" \
        plugins/src/launcher/tritonLauncher.cpp "$BUILD_DIR/triton/tritonCubins.cpp" \
        -L"$CUDA/lib64" -lcudart_static -ldl -lrt -lpthread -o "$BUILD_DIR/libpeagle_kernels.so"
    echo "build_plugins.sh: built $BUILD_DIR/libpeagle_kernels.so"
    exit 0
fi
args=(-S plugins -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DPEAGLE_PYTHON="$PYTHON"
      -DPEAGLE_TRITON_ARCHS="$ARCHS" -DPEAGLE_WERROR="$WERROR")
if [ -n "${TENSORRT_ROOT:-}" ]; then
    args+=(-DTENSORRT_ROOT="$TENSORRT_ROOT")
fi
cmake "${args[@]}" "$@"
cmake --build "$BUILD_DIR" --parallel "${PEAGLE_BUILD_JOBS:-$(nproc)}"
echo "build_plugins.sh: built $(ls "$BUILD_DIR"/libpeagle_*.so | tr '\n' ' ')"
