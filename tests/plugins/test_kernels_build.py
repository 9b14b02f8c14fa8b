"""plugins/ builds without a GPU: the CUDA kernels compile (warnings as errors) for sm_90a and sm_100a
(plus compute_90 PTX) into libpeagle_kernels.so with the C API exported; the TensorRT plugin wrappers
compile with -Werror against TensorRT's REAL public headers (TensorRT 11.1, in
../shared/third_party/tensorrt-11.1/include beside the checkout, or $PEAGLE_TENSORRT_INCLUDE) and
behave (creators, attributes, shapes, types, KV aliasing, serialization); and CMake builds
libpeagle_plugins.so when it finds TensorRT. Nothing here runs a kernel (see test_kernels_gpu.py).

Missing TensorRT headers FAIL these tests (they are what proves the wrappers match TensorRT's API);
missing nvcc / cmake / g++ skip the tests that need them.

Timing on the 2-core CI machine: ~25 s from scratch (the kernel build dominates), ~10 s when
scripts/build_plugins.sh already built plugins/build.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import struct
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
API = ("peagle_kv_attention", "peagle_kv_attention_workspace_size", "peagle_draft_inputs",
       "peagle_draft_sample", "peagle_draft_sample_workspace_size", "peagle_error_string",
       "peagle_kernels_version")
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
    assert len(plugin_objects) == 5 and all(o.stat().st_size > 0 for o in plugin_objects)


@pytest.fixture(scope="module")
def kernels_lib() -> Path:
    """plugins/build/libpeagle_kernels.so, (re)built incrementally with scripts/build_plugins.sh."""
    run_build(DEFAULT_BUILD_DIR)
    lib = DEFAULT_BUILD_DIR / "libpeagle_kernels.so"
    assert lib.is_file()
    return lib


def fatbin_entries(path: Path) -> list[tuple[str, int]]:
    """(kind, sm) of every image in the .nv_fatbin section of an ELF shared library: kind 'elf'
    (SASS) or 'ptx'. Layout: fatbin header (magic 0xBA55ED50, u16 version, u16 header size, u64 size)
    then entries (u16 kind 1=PTX 2=ELF, u16, u32 header size, u64 payload size, ..., u32 sm at +28)."""
    data = path.read_bytes()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = sections[shstrndx][4]

    def name(off: int) -> str:
        return data[strtab + off:data.index(b"\0", strtab + off)].decode()

    out = []
    for sec in sections:
        if name(sec[0]) != ".nv_fatbin":
            continue
        pos, end = sec[4], sec[4] + sec[5]
        while pos + 16 <= end:
            magic, _, hsize, fsize = struct.unpack_from("<IHHQ", data, pos)
            if magic != 0xBA55ED50:
                pos += 8
                continue
            p, stop = pos + hsize, pos + hsize + fsize
            while p < stop:
                kind, _, ehsize, psize = struct.unpack_from("<HHIQ", data, p)
                sm, = struct.unpack_from("<I", data, p + 28)
                out.append(({1: "ptx", 2: "elf"}.get(kind, str(kind)), sm))
                p += ehsize + psize
            pos = stop
    return out


@needs_build_tools
def test_kernels_compile_for_sm90a_and_sm100a(kernels_lib):
    entries = fatbin_entries(kernels_lib)
    # three translation units, each with Hopper and Blackwell SASS and compute_90 PTX
    assert entries.count(("elf", 90)) == 3 and entries.count(("elf", 100)) == 3, entries
    assert entries.count(("ptx", 90)) == 3, entries
    flags = " ".join(p.read_text() for p in (DEFAULT_BUILD_DIR / "CMakeFiles").rglob("flags.make"))
    assert "sm_90a" in flags and "sm_100a" in flags and "compute_90" in flags
    assert "-Werror" in flags and "--Werror=all-warnings" in flags  # our warnings are errors


@needs_build_tools
def test_c_api_is_exported_and_validates_arguments(kernels_lib):
    lib = ctypes.CDLL(str(kernels_lib))  # loads without a GPU (static CUDA runtime)
    for sym in API:
        assert hasattr(lib, sym), sym
    assert lib.peagle_kernels_version() == 2  # 2: the paged KV cache (block tables)

    ws = lib.peagle_kv_attention_workspace_size
    ws.restype, ws.argtypes = ctypes.c_size_t, [ctypes.c_int32] * 5
    per_split = 8 * 8 * 32 * (128 + 1) * 4
    assert ws(8, 8, 32, 128, 8200) == 33 * per_split  # ceil(8200 / 256) splits of [B*S*H, d+1] floats
    assert ws(8, 8, 32, 128, 200) == 0                # short tables are never split
    assert ws(64, 64, 64, 128, 32768) == 0            # more than the 64 MiB budget allows for 2 splits
    assert ws(16, 8, 32, 128, 8200) >= ws(8, 8, 32, 128, 8200)  # monotone in the batch
    assert ws(8, 8, 32, 128, 8192 + 32) >= ws(8, 8, 32, 128, 8192)  # ... and in the keys (M * bs)

    sws = lib.peagle_draft_sample_workspace_size
    sws.restype, sws.argtypes = ctypes.c_size_t, [ctypes.c_int32, ctypes.c_int64]
    assert sws(56, 201088) == 56 * 13 * 12  # 13 chunks of <= 16384 logits, (int64, float) per chunk
    assert sws(56, 1000) == 0

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

    assert call(a12=12) == CUDA_ERROR_INVALID_VALUE  # head_dim not a multiple of 8
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
    setLoggerFinder with 3 creators."""
    gxx, _ = compilers
    src = tmp_path / "nvinfer_stub.cpp"
    src.write_text('extern "C" void* getPluginRegistry() noexcept { return nullptr; }\n')
    nvinfer = tmp_path / "lib" / "libnvinfer.so"
    nvinfer.parent.mkdir()
    subprocess.run([gxx, "-shared", "-fPIC", str(src), "-o", str(nvinfer)], check=True)

    build = tmp_path / "build"
    proc = run_build(build, archs="90a-real",  # one arch keeps this test short
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
    assert n.value == 3 and all(creators[i] for i in range(3))
    assert hasattr(plugins, "peagle_register_plugins")
