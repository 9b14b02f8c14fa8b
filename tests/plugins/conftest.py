"""Shared helpers of the plugin tests: locating g++ / cmake / the CUDA headers / TensorRT's headers and
building plugins/ (its kernels: the Triton kernels compiled ahead of time by this interpreter's triton)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "build_plugins.sh"
DEFAULT_BUILD_DIR = REPO / "plugins" / "build"
# TensorRT's public headers (unmodified), beside the repository in CI and in the worktrees
ENV_TRT_INCLUDE = "PEAGLE_TENSORRT_INCLUDE"
DEFAULT_TRT_INCLUDE = REPO.parent / "shared" / "third_party" / "tensorrt-11.1" / "include"


def tensorrt_include() -> Path:
    """The TensorRT include directory the plugin wrappers are compiled against ($PEAGLE_TENSORRT_INCLUDE,
    else ../shared/third_party/tensorrt-11.1/include relative to the repository root)."""
    env = os.environ.get(ENV_TRT_INCLUDE)
    return Path(env) if env else DEFAULT_TRT_INCLUDE


def find_nvcc() -> str | None:
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def cuda_root() -> Path | None:
    """The CUDA toolkit prefix (include/cuda_runtime_api.h), for compiling host code against it."""
    nvcc = find_nvcc()
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
             str(Path(nvcc).resolve().parent.parent) if nvcc else None, "/usr/local/cuda"]
    for cand in cands:
        if cand and (Path(cand) / "include" / "cuda_runtime_api.h").is_file():
            return Path(cand)
    return None


def build_tools_missing() -> str | None:
    """Why the plugins build cannot run here (None when it can)."""
    if shutil.which("g++") is None:
        return "g++ not found"
    if shutil.which("cmake") is None:
        return "cmake not found"
    if cuda_root() is None:
        return "CUDA toolkit headers not found"
    return None


def run_build(build_dir: Path = DEFAULT_BUILD_DIR, archs: str | None = None,
              tensorrt_root: Path | None = None, timeout: int = 900,
              cmake_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """scripts/build_plugins.sh into `build_dir` with this interpreter as the Triton compiler's Python
    (`archs`: "90;100" style; extra `cmake_args` go to the configure step); raises with the build log
    on failure."""
    env = dict(os.environ, PEAGLE_PYTHON=sys.executable, PEAGLE_PLUGINS_BUILD_DIR=str(build_dir))
    env.pop("TRITON_INTERPRET", None)  # set by tests/ops/test_triton_kernels.py; the build compiles for real
    if archs:
        env["PEAGLE_TRITON_ARCHS"] = archs
    if tensorrt_root is not None:
        env["TENSORRT_ROOT"] = str(tensorrt_root)
    else:
        env.pop("TENSORRT_ROOT", None)
    proc = subprocess.run(["bash", str(BUILD_SCRIPT), *cmake_args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"plugins build failed (rc={proc.returncode}):\n{proc.stdout[-6000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc
