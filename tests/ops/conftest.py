"""tests/ops: the Triton kernels run under Triton's CPU interpreter unless PEAGLE_TRITON_DEVICE=cuda.
TRITON_INTERPRET must be set before the kernels are decorated (when peagle_trt/ops/triton_kernels
is first imported), so it is set here, before any test module of this folder is collected.
Builds started from the tests unset it again (tests/plugins/conftest.py, tests/ops/test_triton_aot.py)."""

from __future__ import annotations

import os

DEVICE = os.environ.get("PEAGLE_TRITON_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
