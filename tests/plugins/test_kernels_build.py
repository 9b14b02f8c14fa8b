"""plugins/ builds without a GPU: the CUDA kernels compile for sm_90a and sm_100a (plus compute_90 PTX)
into libpeagle_kernels.so with the C API exported; the TensorRT plugin wrappers compile and behave
(creators, attributes, shapes, types, KV aliasing, serialization) against an interface stub of
TensorRT's headers; and CMake builds libpeagle_plugins.so when it finds TensorRT. Nothing here runs a
kernel (see test_kernels_gpu.py). Skipped when nvcc / cmake / g++ are missing.

Timing on the 2-core CI machine: ~25 s from scratch (the kernel build dominates), ~10 s when
scripts/build_plugins.sh already built plugins/build.
"""

from __future__ import annotations

import ctypes
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from tests.plugins.conftest import DEFAULT_BUILD_DIR, REPO, build_tools_missing, cuda_root, run_build

pytestmark = pytest.mark.skipif(build_tools_missing() is not None, reason=str(build_tools_missing()))

PLUGINS = REPO / "plugins"
STUB = PLUGINS / "tests" / "trt_stub"
API = ("peagle_kv_attention", "peagle_kv_attention_workspace_size", "peagle_draft_inputs",
       "peagle_draft_sample", "peagle_draft_sample_workspace_size", "peagle_error_string",
       "peagle_kernels_version")
CUDA_ERROR_INVALID_VALUE = 1


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


def test_kernels_compile_for_sm90a_and_sm100a(kernels_lib):
    entries = fatbin_entries(kernels_lib)
    # three translation units, each with Hopper and Blackwell SASS and compute_90 PTX
    assert entries.count(("elf", 90)) == 3 and entries.count(("elf", 100)) == 3, entries
    assert entries.count(("ptx", 90)) == 3, entries
    flags = " ".join(p.read_text() for p in (DEFAULT_BUILD_DIR / "CMakeFiles").rglob("flags.make"))
    assert "sm_90a" in flags and "sm_100a" in flags and "compute_90" in flags


def test_c_api_is_exported_and_validates_arguments(kernels_lib):
    lib = ctypes.CDLL(str(kernels_lib))  # loads without a GPU (static CUDA runtime)
    for sym in API:
        assert hasattr(lib, sym), sym
    assert lib.peagle_kernels_version() == 1

    ws = lib.peagle_kv_attention_workspace_size
    ws.restype, ws.argtypes = ctypes.c_size_t, [ctypes.c_int32] * 5
    per_split = 8 * 8 * 32 * (128 + 1) * 4
    assert ws(8, 8, 32, 128, 8200) == 33 * per_split  # ceil(8200 / 256) splits of [B*S*H, d+1] floats
    assert ws(8, 8, 32, 128, 200) == 0                # short caches are never split
    assert ws(64, 64, 64, 128, 32768) == 0            # more than the 64 MiB budget allows for 2 splits
    assert ws(16, 8, 32, 128, 8200) >= ws(8, 8, 32, 128, 8200)  # monotone in the batch

    sws = lib.peagle_draft_sample_workspace_size
    sws.restype, sws.argtypes = ctypes.c_size_t, [ctypes.c_int32, ctypes.c_int64]
    assert sws(56, 201088) == 56 * 13 * 12  # 13 chunks of <= 16384 logits, (int64, float) per chunk
    assert sws(56, 1000) == 0

    attn = lib.peagle_kv_attention
    attn.restype = ctypes.c_int
    p, i, f = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float
    attn.argtypes = [p] * 8 + [i] * 7 + [f] * 3 + [ctypes.c_int, ctypes.c_int, p, ctypes.c_size_t, i, p]
    dummy = 256
    args = [dummy] * 8 + [2, 4, 8, 2, 64, 4, 100, 0.0, 1.0, 1.0, 1, 1, None, 0, 0, None]
    bad_head_dim = list(args)
    bad_head_dim[12] = 12  # not a multiple of 8
    assert attn(*bad_head_dim) == CUDA_ERROR_INVALID_VALUE
    bad_gqa = list(args)
    bad_gqa[11] = 3  # 8 heads do not split over 3 kv heads
    assert attn(*bad_gqa) == CUDA_ERROR_INVALID_VALUE
    bad_cache = list(args)
    bad_cache[19] = 2  # bf16 cache under fp16 activations
    assert attn(*bad_cache) == CUDA_ERROR_INVALID_VALUE
    bad_scale = list(args)
    bad_scale[19], bad_scale[16] = 3, 0.0  # FP8 cache needs a positive k_scale
    assert attn(*bad_scale) == CUDA_ERROR_INVALID_VALUE
    empty = list(args)
    empty[8] = 0  # batch 0: nothing to do
    assert attn(*empty) == 0


def test_plugin_wrappers_against_the_interface_stub(kernels_lib, tmp_path):
    """Compile the IPluginV3 sources against trt_stub/NvInferRuntime.h (TensorRT 10 signatures) and run
    plugin_host_check.cpp: names, attributes, output shapes/types, formats, aliasing, serialization."""
    gxx = shutil.which("g++") or shutil.which("c++")
    if gxx is None:
        pytest.skip("no C++ compiler")
    cuda = cuda_root()
    cudalib = next((d for d in (cuda / "lib64", cuda / "lib") if (d / "libcudart_static.a").is_file()),
                   cuda / "lib64")
    sources = sorted(str(f) for f in (PLUGINS / "src" / "plugins").glob("*.cpp"))
    exe = tmp_path / "plugin_host_check"
    cmd = [gxx, "-std=c++17", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter", "-O1", f"-I{STUB}",
           f"-I{PLUGINS / 'include'}", f"-I{PLUGINS / 'src' / 'plugins'}", f"-I{cuda / 'include'}",
           str(PLUGINS / "tests" / "plugin_host_check.cpp"), *sources,
           f"-L{kernels_lib.parent}", "-lpeagle_kernels", f"-Wl,-rpath,{kernels_lib.parent}",
           f"-L{cudalib}", "-lcudart_static", "-ldl", "-lpthread", "-lrt", "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-6000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "plugin_host_check: OK" in run.stdout, run.stdout + run.stderr


def test_cmake_builds_the_plugin_library_when_tensorrt_is_found(tmp_path):
    """A fake TensorRT prefix (the stub header as NvInfer.h/NvInferRuntime.h, a dummy libnvinfer.so)
    makes CMake take the plugin branch; the library exports getCreators/setLoggerFinder with 3 creators."""
    gxx = shutil.which("g++") or shutil.which("c++")
    if gxx is None:
        pytest.skip("no C++ compiler")
    trt = tmp_path / "tensorrt"
    (trt / "include").mkdir(parents=True)
    (trt / "lib").mkdir()
    shutil.copy(STUB / "NvInferRuntime.h", trt / "include" / "NvInferRuntime.h")
    (trt / "include" / "NvInfer.h").write_text('#pragma once\n#include "NvInferRuntime.h"\n')
    src = tmp_path / "nvinfer_stub.cpp"
    src.write_text('extern "C" void* getPluginRegistry() noexcept { return nullptr; }\n')
    subprocess.run([gxx, "-shared", "-fPIC", str(src), "-o", str(trt / "lib" / "libnvinfer.so")], check=True)

    build = tmp_path / "build"
    proc = run_build(build, archs="90a-real", tensorrt_root=trt)  # one arch keeps this test short
    assert "TensorRT found" in proc.stdout
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
