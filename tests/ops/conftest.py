"""tests/ops: the Triton kernels run under Triton's CPU interpreter unless PEAGLE_TRITON_DEVICE=cuda.
TRITON_INTERPRET must be set before the kernels are decorated (when peagle_trt/ops/triton_kernels
is first imported), so it is set here, before any test module of this folder is collected.
Builds started from the tests unset it again (tests/plugins/conftest.py, tests/ops/test_triton_aot.py)."""

from __future__ import annotations

import os

DEVICE = os.environ.get("PEAGLE_TRITON_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"


def other_triton() -> str | None:
    """Why a check of the pinned Triton's code generation (registers, spills, SASS) does not apply here: the
    installed Triton is not constraints.txt's (a GPU image's own, e.g. 3.6 on the H200 image, where the
    FP8 GEMM's 4-row-group tiles spill); None where it is the pinned one. Their speed is `bench kernels`'."""
    from importlib.metadata import version
    from pathlib import Path

    lines = (Path(__file__).resolve().parents[2] / "constraints.txt").read_text().splitlines()
    pinned = next(line.split("==")[1].strip() for line in lines if line.startswith("triton=="))
    installed = version("triton")
    return None if installed == pinned else f"Triton {installed} is installed, the checks are for {pinned}"


def rowwise_dot(monkeypatch, tail_reversed_from: int | None = None) -> None:
    """Under the interpreter, make `tl.dot` compute each output element the way a GPU does: from
    its own row of `a` and column of `b` alone, products summed in k order, whatever the tile's
    shape or the row's place in it.

    The interpreter's own `tl.dot` is `np.matmul`, i.e. numpy's OpenBLAS, whose GEMM microkernels
    (picked by CPU: OPENBLAS_CORETYPE=Haswell/Zen use FMA and handle edge rows apart) give a row
    different last bits by its position in the matrix. A property a kernel guarantees "given a dot
    whose element does not depend on its neighbours" (the GPU's MMA and its IEEE fp32 FMA loop)
    cannot be tested on that arithmetic: this puts the GPU's contract in its place, for the test
    that calls it. Only 2-D operands (the kernels' tiles); fp8 operands go through fp16 first, as
    the interpreter does. `tail_reversed_from=R` breaks the contract on purpose, as a BLAS edge
    kernel does: tile rows R and up sum their products in the opposite order."""
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2 or b.data.ndim != 2 or a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        x, y = a.data.astype(acc), b.data.astype(acc)  # [M, K], [K, N]
        total = x[:, 0, None] * y[None, 0, :]  # [M, N]: elementwise products, exact IEEE ops
        for k in range(1, x.shape[1]):
            total = total + x[:, k, None] * y[None, k, :]
        if tail_reversed_from is not None:
            tail = x[tail_reversed_from:, ::-1]
            flipped = tail[:, 0, None] * y[None, -1, :]
            for k in range(1, x.shape[1]):
                flipped = flipped + tail[:, k, None] * y[None, -1 - k, :]
            total[tail_reversed_from:] = flipped
        return interpreter.TensorHandle(total + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
