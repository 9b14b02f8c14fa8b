"""The CPU kinds the suite must hold on, as kernel selections any x86 machine can make, and the
exactness-sensitive tests run under each (tests/test_cpu_kinds.py; the README, "CPU kinds").

Why: CI runs on whichever 2-core machine a session had: an AMD EPYC (OpenBLAS at its Haswell/Zen
FMA kernels, through OPENBLAS_CORETYPE) or an Intel Xeon (AVX-512 kernels). A bit-exactness test
that holds on one kind only went red twice (the kernel's batch invariance on AMD, the FP8 gate on
Intel). The libraries pick their kernels by CPU, and each can be told to pick another kind's:

- numpy's OpenBLAS (the Triton interpreter's `tl.dot`, numpy maths): OPENBLAS_CORETYPE;
- torch's MKL GEMMs: MKL_ENABLE_INSTRUCTIONS (a ceiling: MKL may still pick a lower path);
- torch's own vectorised kernels: ATEN_CPU_CAPABILITY; oneDNN: ONEDNN_MAX_CPU_ISA.

onnxruntime's MLAS dispatches by CPUID alone (no such switch): its kernels follow the machine.
A kind runs where the CPU has its instructions (/proc/cpuinfo flags): on an AVX-512 machine all
three, on an AVX2-only EPYC `avx2` and `avx`.

Reproduce one kind by hand: `env $(python -m tests.cpu_kinds avx2) .venv/bin/python -m pytest -m exact`
(prints the kind's variables); or `pytest tests/test_cpu_kinds.py -k avx2`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Kind:
    env: dict[str, str]  # the kernel selection
    needs: tuple[str, ...]  # /proc/cpuinfo flags it runs on
    machine: str  # which machine picks these kernels by itself


KINDS = {
    "avx2": Kind({"OPENBLAS_CORETYPE": "Haswell", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
                  "ONEDNN_MAX_CPU_ISA": "AVX2"}, ("avx2", "fma"), "AMD EPYC (AVX2, FMA)"),
    "avx512": Kind({"OPENBLAS_CORETYPE": "SkylakeX", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
                    "ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
                   ("avx512f", "avx512bw", "avx512dq", "avx512vl"), "Intel Xeon (AVX-512)"),
    "avx": Kind({"OPENBLAS_CORETYPE": "Sandybridge", "MKL_ENABLE_INSTRUCTIONS": "AVX",
                 "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX"}, ("avx",),
                "an x86 CPU without FMA (OpenBLAS's Sandybridge kernels: multiply, then add)"),
}

# The exactness-sensitive tests (node-id prefixes): each asserts bits or tokens equal across
# launches, batch compositions, speculation or thread counts. conftest.py marks them `exact`.
EXACT = (
    "tests/ops/test_triton_kernels.py::test_kv_attention_row_is_batch_invariant",
    "tests/ops/test_triton_kernels.py::test_batch_invariance_check_sees_a_row_dependent_dot",
    "tests/ops/test_kv_attention_split.py::test_deterministic",
    "tests/ops/test_fp8_linear.py::test_a_rows_bits",
    "tests/ops/test_moe_kernel.py::test_a_rows_output_does_not_depend_on_the_other_rows",
    "tests/ops/test_moe_kernel.py::test_the_row_check_sees_a_row_dependent_dot",
    "tests/executors/test_deterministic.py",
    "tests/e2e/test_greedy_exactness.py",
    "tests/quantize/test_fp8.py",
    "tests/export/test_fp8_onnx.py",
    "tests/e2e/test_kv_fp8.py::test_speculative_equals_target_only_with_fp8_caches",
    "tests/ops/test_fp8_kv_cache.py::test_e4m3_bits_equal_torch_float8",
)


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def runnable(name: str, flags: set[str] | None = None) -> bool:
    """Whether this CPU has the instructions of kind `name`'s kernels."""
    return set(KINDS[name].needs) <= (cpu_flags() if flags is None else flags)


def is_exact(nodeid: str) -> bool:
    return nodeid.startswith(EXACT)


if __name__ == "__main__":  # python -m tests.cpu_kinds KIND: its variables, for `env`
    kind = KINDS.get(sys.argv[1] if len(sys.argv) > 1 else "")
    if kind is None:
        sys.exit(f"usage: python -m tests.cpu_kinds {{{','.join(KINDS)}}}")
    print(" ".join(f"{k}={v}" for k, v in kind.env.items()))
