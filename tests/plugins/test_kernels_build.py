"""plugins/ builds without a GPU: the Triton kernels compile ahead of time to sm_90a and sm_100a cubins
(no spill, registers and shared memory within limits: aot.py's checks) that are embedded in
libpeagle_kernels.so, whose C API (the hand-written launcher, warnings as errors) is exported and
validates its arguments; the TensorRT plugin wrappers
compile with -Werror against TensorRT's REAL public headers (TensorRT 11.1, in
../shared/third_party/tensorrt-11.1/include beside the checkout, or $PEAGLE_TENSORRT_INCLUDE) and
behave (creators, attributes, shapes, types, KV aliasing, serialization); and CMake builds
libpeagle_plugins.so when it finds TensorRT. Nothing here runs a kernel (see test_kernels_gpu.py).

Missing TensorRT headers FAIL these tests (they are what proves the wrappers match TensorRT's API);
missing cmake / g++ / CUDA headers skip the tests that need them.

Timing on a 2-core machine: 3:47 from scratch on 2 cores shared with other jobs (most of it compiling 190 cubins,
98 of them the fused MoE's), ~20 s when Triton's cache (~/.triton/cache) or plugins/build already holds them.
"""

from __future__ import annotations

import ctypes
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.plugins.conftest import (
    DEFAULT_BUILD_DIR,
    ENV_TRT_INCLUDE,
    REPO,
    build_tools_missing,
    cuda_root,
    run_build,
    tensorrt_include,
)

PLUGINS = REPO / "plugins"
API = ("peagle_kv_attention", "peagle_kv_attention_tree", "peagle_kv_attention_workspace_size", "peagle_draft_inputs",
       "peagle_draft_sample", "peagle_draft_sample_workspace_size", "peagle_moe", "peagle_moe_workspace_size",
       "peagle_error_string", "peagle_kernels_version")
CUDA_ERROR_INVALID_VALUE = 1
# what CMake uses for the plugin sources (plugins/CMakeLists.txt, PEAGLE_HOST_WARNINGS)
HOST_WARNINGS = ("-Wall", "-Wextra", "-Wpedantic", "-Wsuggest-override", "-Woverloaded-virtual",
                 "-Wnon-virtual-dtor", "-Werror")
needs_build_tools = pytest.mark.skipif(build_tools_missing() is not None, reason=str(build_tools_missing()))


@pytest.fixture(scope="module")
def trt_include() -> Path:
    """TensorRT's public include directory; a test FAILURE (not a skip) when it is missing."""
    inc = tensorrt_include()
    missing = [h for h in ("NvInferRuntime.h", "NvInferPluginBase.h", "NvInferVersion.h", "NvOnnxParser.h")
               if not (inc / h).is_file()]
    if missing:
        pytest.fail(f"TensorRT's public headers are missing: {missing} not in {inc}. The plugin wrappers "
                    "are compiled against them in CI; put the TensorRT 11.1 headers at "
                    f"../shared/third_party/tensorrt-11.1/include beside the checkout or set ${ENV_TRT_INCLUDE}")
    return inc


@pytest.fixture(scope="module")
def compilers() -> tuple[str, Path]:
    """(g++, CUDA toolkit prefix) for host code; skips without them."""
    gxx = shutil.which("g++") or shutil.which("c++")
    cuda = cuda_root()
    if gxx is None or cuda is None:
        pytest.skip("no C++ compiler" if gxx is None else "CUDA toolkit headers not found")
    return gxx, cuda


@pytest.fixture(scope="module")
def plugin_objects(trt_include, compilers, tmp_path_factory) -> list[Path]:
    """The plugin sources and plugin_host_check.cpp compiled to objects against the real headers
    (TensorRT's and CUDA's as -isystem, our own sources with -Werror)."""
    gxx, cuda = compilers
    out = tmp_path_factory.mktemp("plugin_objs")
    sources = sorted((PLUGINS / "src" / "plugins").glob("*.cpp")) + [PLUGINS / "tests" / "plugin_host_check.cpp"]
    objs = []
    for src in sources:
        obj = out / (src.stem + ".o")
        cmd = [gxx, "-std=c++17", *HOST_WARNINGS, "-O1", "-fPIC", "-isystem", str(trt_include),
               "-isystem", str(cuda / "include"), f"-I{PLUGINS / 'include'}", f"-I{PLUGINS / 'src' / 'plugins'}",
               "-c", str(src), "-o", str(obj)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, f"{src.name} does not compile against {trt_include}:\n{proc.stderr[-6000:]}"
        objs.append(obj)
    return objs


def test_the_headers_are_tensorrt_11_1(trt_include):
    version = (trt_include / "NvInferVersion.h").read_text()
    major = re.search(r"#define TRT_MAJOR_ENTERPRISE (\d+)", version)
    minor = re.search(r"#define TRT_MINOR_ENTERPRISE (\d+)", version)
    assert major and minor and (int(major[1]), int(minor[1])) == (11, 1), "expected TensorRT 11.1 headers"
    api = (trt_include / "NvInferRuntime.h").read_text()
    for cls in ("class IPluginV3OneCore", "class IPluginV3OneBuild", "class IPluginV3OneRuntime",
                "class IPluginCreatorV3One", "using IPluginV3OneBuildV2"):
        assert cls in api, cls


def test_plugin_wrappers_compile_against_tensorrt_headers(plugin_objects):
    """Every override (`override` + `noexcept` on each) matches IPluginV3OneCore / IPluginV3OneBuildV2 /
    IPluginV3OneRuntime / IPluginCreatorV3One of the real headers, no plugin class is abstract
    (static_asserts in plugin_host_check.cpp), and our sources compile without a warning."""
    assert len(plugin_objects) == 6 and all(o.stat().st_size > 0 for o in plugin_objects)


@pytest.fixture(scope="module")
def kernels_lib() -> Path:
    """plugins/build/libpeagle_kernels.so, (re)built incrementally with scripts/build_plugins.sh."""
    run_build(DEFAULT_BUILD_DIR)
    lib = DEFAULT_BUILD_DIR / "libpeagle_kernels.so"
    assert lib.is_file()
    return lib


def cubin_arch(cubin: bytes) -> str:
    """The sm_XXa a cubin is for, as Triton's bundled cuobjdump reads its ELF header."""
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        head = subprocess.run([str(tool), "-elf", f.name], capture_output=True, text=True, check=True).stdout
    return re.search(r"sm=(\w+)", head)[1]


@needs_build_tools
def test_the_library_embeds_the_cubins_for_sm90a_and_sm100a(kernels_lib):
    """Every cubin of the manifest is inside libpeagle_kernels.so byte for byte, its ELF header names
    its architecture, both architectures hold every variant, and none spills."""
    manifest = json.loads((DEFAULT_BUILD_DIR / "triton" / "manifest.json").read_text())
    assert manifest["violations"] == []
    cubins = manifest["cubins"]
    library = kernels_lib.read_bytes()
    by_arch = {90: set(), 100: set()}
    for entry in cubins:
        blob = (DEFAULT_BUILD_DIR / "triton" / entry["file"]).read_bytes()
        assert blob in library, f"{entry['file']} is not embedded"
        by_arch[entry["arch"]].add(entry["variant"])
        assert entry["local"] == 0 and entry["stack"] == 0 and entry["registers"] <= 255
    assert by_arch[90] == by_arch[100] and len(by_arch[90]) == len(cubins) // 2
    for entry in (cubins[0], cubins[1]):  # one per architecture: the ELF header agrees with the manifest
        blob = (DEFAULT_BUILD_DIR / "triton" / entry["file"]).read_bytes()
        assert cubin_arch(blob) == f"{entry['arch']}a"
    assert {e["variant"].split(".")[0] for e in cubins} == {"kv_attention", "kv_write", "draft_inputs",
                                                            "draft_sample", "moe_route", "moe_align", "moe_quant",
                                                            "moe_gate_up", "moe_down", "moe_sum"}
    flags = " ".join(p.read_text() for p in (DEFAULT_BUILD_DIR / "CMakeFiles").rglob("flags.make"))
    assert "-Werror" in flags  # our warnings are errors


@needs_build_tools
def test_c_api_is_exported_and_validates_arguments(kernels_lib):
    lib = ctypes.CDLL(str(kernels_lib))  # loads without a GPU (static CUDA runtime)
    for sym in API:
        assert hasattr(lib, sym), sym
    assert lib.peagle_kernels_version() == 4  # 4: peagle_moe

    ws = lib.peagle_kv_attention_workspace_size
    ws.restype, ws.argtypes = ctypes.c_size_t, [ctypes.c_int32] * 5
    assert ws(8, 8, 32, 128, 8200) == 0
    sws = lib.peagle_draft_sample_workspace_size
    sws.restype, sws.argtypes = ctypes.c_size_t, [ctypes.c_int32, ctypes.c_int64]
    assert sws(56, 201088) == 0

    attn = lib.peagle_kv_attention
    attn.restype = ctypes.c_int
    p, i, f = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float
    attn.argtypes = [p] * 8 + [i] * 8 + [f] * 3 + [ctypes.c_int, ctypes.c_int, p, ctypes.c_size_t, i, p]
    dummy = 256
    # q k v positions block_tables k_cache v_cache out; B S H KV d; cache blocks (+ trash), block size, M
    args = [dummy] * 8 + [2, 4, 8, 2, 64, 9, 32, 4, 0.0, 1.0, 1.0, 1, 1, None, 0, 0, None]

    def call(**changes):
        a = list(args)
        for index, value in changes.items():
            a[int(index[1:])] = value
        return attn(*a)

    assert call(a12=96) == CUDA_ERROR_INVALID_VALUE  # no compiled variant for head_dim 96 (64, 128, 256)
    assert call(a11=3) == CUDA_ERROR_INVALID_VALUE  # 8 heads do not split over 3 kv heads
    assert call(a20=2) == CUDA_ERROR_INVALID_VALUE  # bf16 cache under fp16 activations
    assert call(a20=3, a17=0.0) == CUDA_ERROR_INVALID_VALUE  # FP8 cache needs a positive k_scale
    assert call(a13=0) == CUDA_ERROR_INVALID_VALUE  # no cache block (not even the trash block)
    assert call(a14=0) == CUDA_ERROR_INVALID_VALUE  # block size 0
    assert call(a15=0) == CUDA_ERROR_INVALID_VALUE  # empty block tables
    assert call(a14=1 << 12, a15=1 << 20) == CUDA_ERROR_INVALID_VALUE  # M * bs past int32
    assert call(a4=None) == CUDA_ERROR_INVALID_VALUE  # no block tables
    assert call(a8=0) == 0  # batch 0: nothing to do


@needs_build_tools
def test_the_moe_entry_point_sizes_its_workspace_and_validates_its_arguments(kernels_lib):
    """peagle_moe_workspace_size is the layout of peagle_trt/ops/triton_kernels/moe.py `workspace_bytes`;
    peagle_moe refuses what no compiled variant takes before launching anything (no GPU here)."""
    import torch

    from peagle_trt.ops.triton_kernels import moe

    lib = ctypes.CDLL(str(kernels_lib))
    size = lib.peagle_moe_workspace_size
    size.restype, size.argtypes = ctypes.c_size_t, [ctypes.c_int32] * 7
    dtypes = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16}
    kinds = ("none", "tensor", "channel", "block")
    for t, h, e, i, k, act, kind in ((1, 2048, 128, 768, 8, 2, 3), (64, 2048, 128, 768, 8, 1, 2),
                                     (8, 2880, 32, 2880, 4, 2, 0), (12, 256, 8, 128, 2, 0, 0),
                                     (40, 512, 64, 256, 6, 1, 1)):
        assert size(t, h, e, i, k, act, kind) == moe.workspace_bytes(t, h, e, i, k, dtypes[act], kinds[kind])
    assert size(1, 2048, 257, 768, 8, 2, 3) == 0  # more experts than the compiled routing takes
    assert size(1, 2048, 128, 768, 9, 2, 3) == 0  # top_k > 8
    assert size(1, 2000, 128, 768, 8, 2, 3) == 0  # H not a multiple of 128 (FP8's BLOCK_K)
    assert size(1, 2048, 128, 768, 8, 0, 3) == 0  # FP8 under fp32 activations: no variant

    run = lib.peagle_moe
    run.restype = ctypes.c_int
    p, i32, f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float
    run.argtypes = [p] * 12 + [i32] * 8 + [f32, f32] + [ctypes.c_int] * 3 + [p, ctypes.c_size_t, p]
    # x logits w13 w2 b13 b2 expert_scale w13_scale w2_scale a13 a2 y; T H E I k routing renorm act; alpha limit;
    # act logits kind; workspace, bytes, stream: Qwen3-30B-A3B's FP8 block layer at T = 1
    ws = moe.workspace_bytes(1, 2048, 128, 768, 8, torch.bfloat16, "block")
    args = [256] * 4 + [None] * 3 + [256, 256, None, None, 256] + [1, 2048, 128, 768, 8, 0, 1, 0] + [1.702, 7.0]
    args += [2, 2, 3, 256, ws, None]

    def call(**changes):
        a = list(args)
        for index, value in changes.items():
            a[int(index[1:])] = value
        return run(*a)

    assert call(a12=0) == 0  # no rows: nothing to do
    assert call(a0=None) == CUDA_ERROR_INVALID_VALUE  # no x
    assert call(a7=None) == CUDA_ERROR_INVALID_VALUE  # FP8 without w13_scale
    assert call(a9=256, a10=256) == CUDA_ERROR_INVALID_VALUE  # static activation scales with block scales
    assert call(a24=1) == CUDA_ERROR_INVALID_VALUE  # per-tensor scales without a13 / a2
    assert call(a15=64) == CUDA_ERROR_INVALID_VALUE  # I = 64: not a multiple of 128 (FP8's BLOCK_K)
    assert call(a17=2) == CUDA_ERROR_INVALID_VALUE  # routing 2: none such
    assert call(a19=3) == CUDA_ERROR_INVALID_VALUE  # activation 3: none such
    need = moe.workspace_bytes(1, 2048, 128, 768, 8, torch.bfloat16, "block", block_m=16)  # T = 1: 16-row blocks
    assert need < ws and call(a26=need - 1) == CUDA_ERROR_INVALID_VALUE  # workspace too small
    assert call(a25=None) == CUDA_ERROR_INVALID_VALUE  # no workspace


@needs_build_tools
def test_plugin_wrappers_behave(plugin_objects, compilers, kernels_lib, tmp_path):
    """Link the wrappers (compiled against the real headers) with libpeagle_kernels.so and run
    plugin_host_check.cpp: names, attributes, output shapes/types, formats, aliasing, serialization."""
    gxx, cuda = compilers
    cudalib = next((d for d in (cuda / "lib64", cuda / "lib") if (d / "libcudart_static.a").is_file()),
                   cuda / "lib64")
    exe = tmp_path / "plugin_host_check"
    cmd = [gxx, *map(str, plugin_objects), f"-L{kernels_lib.parent}", "-lpeagle_kernels",
           f"-Wl,-rpath,{kernels_lib.parent}", f"-L{cudalib}", "-lcudart_static", "-ldl", "-lpthread", "-lrt",
           "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-6000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "plugin_host_check: OK" in run.stdout, run.stdout + run.stderr


@needs_build_tools
def test_cmake_builds_the_plugin_library_when_tensorrt_is_found(trt_include, compilers, tmp_path):
    """CMake pointed at the real headers and a dummy libnvinfer.so takes the plugin branch and builds the
    wrappers with -Werror (TensorRT's headers as -isystem); the library exports getCreators /
    setLoggerFinder with 4 creators."""
    gxx, _ = compilers
    src = tmp_path / "nvinfer_stub.cpp"
    src.write_text('extern "C" void* getPluginRegistry() noexcept { return nullptr; }\n')
    nvinfer = tmp_path / "lib" / "libnvinfer.so"
    nvinfer.parent.mkdir()
    subprocess.run([gxx, "-shared", "-fPIC", str(src), "-o", str(nvinfer)], check=True)

    build = tmp_path / "build"
    proc = run_build(build, archs="90",  # one arch keeps this test short
                     cmake_args=(f"-DTENSORRT_INCLUDE_DIR={trt_include}", f"-DTENSORRT_NVINFER_LIB={nvinfer}"))
    assert "TensorRT found" in proc.stdout
    flags = (build / "CMakeFiles" / "peagle_plugins.dir" / "flags.make").read_text()
    assert f"-isystem {trt_include}" in flags and "-Werror" in flags, flags
    lib = build / "libpeagle_plugins.so"
    assert lib.is_file()

    plugins = ctypes.CDLL(str(lib))
    plugins.setLoggerFinder.argtypes = [ctypes.c_void_p]
    plugins.setLoggerFinder(None)
    plugins.getCreators.restype = ctypes.POINTER(ctypes.c_void_p)
    plugins.getCreators.argtypes = [ctypes.POINTER(ctypes.c_int32)]  # int32_t& is a pointer in the ABI
    n = ctypes.c_int32(0)
    creators = plugins.getCreators(ctypes.byref(n))
    assert n.value == 4 and all(creators[i] for i in range(4))
    assert hasattr(plugins, "peagle_register_plugins")
