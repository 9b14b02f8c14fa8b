"""The Triton FP8 GEMM (peagle_trt/ops/triton_kernels/fp8_linear.py) against the dequantized product
(`peagle_trt.models.fp8.fp8_linear_reference`), under the Triton interpreter; how `FP8Linear` picks
its path (`choose_path`: the dequant path on CPU, in deterministic mode and with the kernels off).

What it checks: M = 1..40 (one and several 16-row tiles), N and K that are not multiples of the
tiles, bias or none, fp32 / fp16 / bf16 activations, activations past the clamp (+-448 x scale) and
on E4M3 rounding carries (the interpreter's own conversion drops them), a row's bits independent
of the other rows, the kernel against FP8Linear's dequant path within the activation dtype's
tolerance, the launcher's errors. Outputs are poisoned with NaN. On a GPU
(PEAGLE_TRITON_DEVICE=cuda) the same, plus `torch._scaled_mm` and FP8Linear under `kernels.enable()`.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.conftest import DEVICE  # sets TRITON_INTERPRET=1 on CPU, before the kernels are imported

pytest.importorskip("triton", reason="pip install -c constraints.txt 'peagle-trt[dev]' (triton==3.9.0)")

from peagle_trt.models.fp8 import (  # noqa: E402
    FP8_DTYPE,
    FP8_MAX,
    FP8Linear,
    choose_path,
    fp8_linear_reference,
    linear_path,
)
from peagle_trt.ops.triton_kernels import fp8_linear  # noqa: E402

pytestmark = pytest.mark.kernels
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=1e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=8e-3)}


def _layer(gen, n, k, bias, dtype):
    """An FP8Linear with ModelOpt-style contents: weight codes of a random W, amax / 448 scales."""
    w = torch.randn(n, k, generator=gen) * 0.1
    layer = FP8Linear(k, n, bias)
    layer.weight_scale.data = w.abs().max() / FP8_MAX
    layer.weight.data = (w / layer.weight_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    layer.input_scale.data = torch.tensor(3.0 / FP8_MAX)  # activations of amax ~3: some clamp
    if bias:
        layer.bias.data = torch.randn(n, generator=gen).to(dtype)
    return layer


def _run(x, layer):
    out = torch.full((*x.shape[:-1], layer.out_features), float("nan"), dtype=x.dtype, device=DEVICE)
    got = fp8_linear.fp8_linear(x.to(DEVICE), layer.weight.to(DEVICE), layer.weight_scale.to(DEVICE),
                                layer.input_scale.to(DEVICE), None if layer.bias is None else layer.bias.to(DEVICE),
                                out=out)
    return got.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (3, 24, 100), (16, 200, 300), (40, 72, 128)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_matches_the_dequantized_product(dtype, m, n, k, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    layer = _layer(gen, n, k, bias, dtype)
    x = (torch.randn(m, k, generator=gen) * 2).to(dtype)  # some past the clamp (|x| > 3)
    got = _run(x, layer)
    assert torch.isfinite(got).all(), "a NaN reached the output (an unwritten element)"
    want = fp8_linear_reference(x, layer.weight, layer.weight_scale, layer.input_scale, layer.bias)
    torch.testing.assert_close(got, want, **TOL[dtype])
    # and FP8Linear's dequant path (bf16 roundings of the scaled weight and activation aside)
    torch.testing.assert_close(got.float(), layer(x).float(), **TOL[torch.bfloat16 if dtype != torch.float32
                                                                      else torch.float16])


def test_fp8_linear_rounds_activations_as_torch_does():
    """Activations on E4M3 rounding carries (7.8 -> 8.0, 15.6 -> 16), halfway ties, past +-448 and
    subnormal: with a one-hot weight, each output is one activation code times the scales."""
    k = 32
    x = torch.tensor([[7.8, -15.6, 0.0137, 1e-3, 500.0, -1e4, 4.5, 5.5, 3.0625, 0.30078125] + [1.0] * 22])
    layer = FP8Linear(k, k)
    layer.weight.data = torch.eye(k).to(FP8_DTYPE)
    layer.weight_scale.data = torch.tensor(1.0)
    layer.input_scale.data = torch.tensor(1.0)
    got = _run(x, layer)
    want = fp8_linear_reference(x, layer.weight, layer.weight_scale, layer.input_scale)
    assert torch.equal(got, want), (got[0, :10], want[0, :10])


def test_a_rows_bits_do_not_depend_on_the_other_rows():
    gen = torch.Generator().manual_seed(4)
    layer = _layer(gen, 48, 160, True, torch.float32)
    x = torch.randn(37, 160, generator=gen)
    alone = _run(x[5:6], layer)
    assert torch.equal(_run(x, layer)[5:6], alone)
    assert torch.equal(_run(torch.cat([x[5:6], -x[:20]]), layer)[:1], alone)


def test_fp8_linear_keeps_leading_dims_and_checks_its_inputs():
    gen = torch.Generator().manual_seed(1)
    layer = _layer(gen, 16, 32, False, torch.bfloat16)
    x = torch.randn(2, 3, 32, generator=gen).to(torch.bfloat16)
    assert _run(x, layer).shape == (2, 3, 16)
    w, ws, xs = layer.weight, layer.weight_scale, layer.input_scale
    with pytest.raises(ValueError, match="last dim must be 32"):
        fp8_linear.fp8_linear(torch.zeros(1, 31), w, ws, xs)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8_linear.fp8_linear(torch.zeros(1, 32), w.float(), ws, xs)
    with pytest.raises(ValueError, match="per-tensor"):
        fp8_linear.fp8_linear(torch.zeros(1, 32), w, torch.ones(16), xs)
    with pytest.raises(ValueError, match="bias must be"):
        fp8_linear.fp8_linear(torch.zeros(1, 32), w, ws, xs, torch.zeros(3))


def test_block_n_depends_on_n_only():
    assert fp8_linear.block_n(28672) == 64 and fp8_linear.block_n(4096) == 16 and fp8_linear.block_n(100) == 16
    assert fp8_linear.block_n(65536) == 128


def test_paths():
    kw = dict(cuda=True, kernels_on=True, deterministic=False)
    assert choose_path(1, 4096, 4096, **kw) == "triton"
    assert choose_path(64, 4096, 4096, **kw) == "triton"
    assert choose_path(65, 4096, 4096, **kw) == "scaled_mm"
    assert choose_path(65, 4096, 4100, **kw) == "triton"  # _scaled_mm wants multiples of 16
    for off in ("cuda", "kernels_on"):
        assert choose_path(1, 4096, 4096, **dict(kw, **{off: False})) == "dequant"
    assert choose_path(1, 4096, 4096, **dict(kw, deterministic=True)) == "dequant"  # row-blocked F.linear
    assert linear_path(torch.zeros(1, 32), 32, 16) == "dequant"  # CPU: the exact path, always


def test_fp8_linear_compiles_for_sm90a_and_sm100a_without_spills(tmp_path):
    """`aot.py --jit-only`: the FP8 GEMM as real cubins (FP8 tensor-core dot), resources checked."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(repo), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-m", "peagle_trt.ops.triton_kernels.aot", str(tmp_path), "--jit-only",
                           "--only", "fp8_linear.bf16"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["violations"] == [] and len(manifest["cubins"]) == 8, manifest


@pytest.mark.skipif(DEVICE != "cuda", reason="torch._scaled_mm and kernels.enable() need a GPU")
def test_fp8linear_on_the_gpu_paths():
    from peagle_trt.ops import kernels

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 matmuls need sm_89+")
    gen = torch.Generator().manual_seed(0)
    layer = _layer(gen, 512, 1024, True, torch.bfloat16).to("cuda")
    kernels.enable()
    try:
        for m in (1, 8, 64, 65, 256):
            x = torch.randn(m, 1024, generator=gen).to(torch.bfloat16).to("cuda")
            assert linear_path(x, 1024, 512) == ("triton" if m <= 64 else "scaled_mm")
            want = fp8_linear_reference(x, layer.weight, layer.weight_scale, layer.input_scale, layer.bias)
            torch.testing.assert_close(layer(x), want, **TOL[torch.bfloat16])
    finally:
        kernels.disable()
    assert linear_path(x, 1024, 512) == "dequant"
