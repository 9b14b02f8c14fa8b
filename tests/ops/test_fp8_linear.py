"""The Triton FP8 GEMM (peagle_trt/ops/triton_kernels/fp8_linear.py) against the dequantized product
(`peagle_trt.models.fp8.fp8_linear_reference`), under the Triton interpreter; how `FP8Linear` picks
its path (`choose_path`: the dequant path on CPU, in deterministic mode and with the kernels off).

What it checks: M = 1..64 in both regimes (one row group with x quantized in the GEMM; up to four
groups per weight tile with x quantized first by its own kernel), N and K that are not multiples
of the tiles and ALIGNED ones (full K steps, no K mask), split-K (the fp32 partials and the
in-order reduce; segments that do not divide the steps), every config of CANDIDATES, bias or none,
fp32 / fp16 / bf16 activations, activations past the clamp (+-448 x scale) and on E4M3 rounding
carries (the interpreter's own conversion drops them), a row's bits independent of the other rows
and of M across the regimes (on `rowwise_dot`, the GPU's per-element dot), the config choice by
shape, the launcher's and FP8Config's errors, and the sm_90a / sm_100a compiles (wgmma / tcgen05,
16-byte cp.async weight copies, no spills). Outputs are poisoned with NaN. On a GPU
(PEAGLE_TRITON_DEVICE=cuda) the same, plus `torch._scaled_mm` and FP8Linear under `kernels.enable()`.
"""

from __future__ import annotations

import pytest
import torch

# (tests.ops.conftest sets TRITON_INTERPRET=1 on CPU, before the kernels are imported)
from tests.ops.conftest import DEVICE, other_triton, rowwise_dot

pytest.importorskip("triton", reason="pip install -c constraints.txt 'peagle-trt[dev]' (triton==3.9.0)")

from peagle_trt.errors import ConfigError  # noqa: E402
from peagle_trt.models.fp8 import (  # noqa: E402
    FP8_DTYPE,
    FP8_MAX,
    FP8Linear,
    choose_path,
    fp8_linear_reference,
    linear_path,
)
from peagle_trt.ops.triton_kernels import fp8_linear  # noqa: E402
from peagle_trt.ops.triton_kernels.fp8_linear import CANDIDATES, FP8Config, choose_config  # noqa: E402

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


def _run(x, layer, config=None):
    out = torch.full((*x.shape[:-1], layer.out_features), float("nan"), dtype=x.dtype, device=DEVICE)
    got = fp8_linear.fp8_linear(x.to(DEVICE), layer.weight.to(DEVICE), layer.weight_scale.to(DEVICE),
                                layer.input_scale.to(DEVICE), None if layer.bias is None else layer.bias.to(DEVICE),
                                out=out, config=config)
    return got.cpu()


def _check(x, layer, config=None):
    got = _run(x, layer, config)
    assert torch.isfinite(got).all(), "a NaN reached the output (an unwritten element)"
    want = fp8_linear_reference(x, layer.weight, layer.weight_scale, layer.input_scale, layer.bias)
    torch.testing.assert_close(got, want, **TOL[x.dtype])
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (3, 24, 100), (16, 200, 300), (40, 72, 128), (2, 96, 256),
                                   (64, 144, 384)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_matches_the_dequantized_product(dtype, m, n, k, bias):
    """Default configs: gemv (M <= 16, x quantized in the GEMM) and small (x quantized first, 2 or 4
    row groups per program); (2, 96, 256) and (64, 144, 384) ALIGNED (K in whole 128-steps, N % 16)."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    layer = _layer(gen, n, k, bias, dtype)
    x = (torch.randn(m, k, generator=gen) * 2).to(dtype)  # some past the clamp (|x| > 3)
    got = _check(x, layer)
    if k <= 300:  # and FP8Linear's dequant path (its bf16 roundings of the scaled weight, which grow with K, aside)
        torch.testing.assert_close(got.float(), layer(x).float(), **TOL[torch.bfloat16 if dtype != torch.float32
                                                                          else torch.float16])


@pytest.mark.parametrize("prequant", [False, True])
def test_fp8_linear_rounds_activations_as_torch_does(prequant):
    """Activations on E4M3 rounding carries (7.8 -> 8.0, 15.6 -> 16), halfway ties, past +-448 and
    subnormal: with a one-hot weight, each output is one activation code times the scales; x
    quantized in the GEMM and by the quantize kernel."""
    k = 32
    x = torch.tensor([[7.8, -15.6, 0.0137, 1e-3, 500.0, -1e4, 4.5, 5.5, 3.0625, 0.30078125] + [1.0] * 22])
    layer = FP8Linear(k, k)
    layer.weight.data = torch.eye(k).to(FP8_DTYPE)
    layer.weight_scale.data = torch.tensor(1.0)
    layer.input_scale.data = torch.tensor(1.0)
    got = _run(x, layer, FP8Config(prequant=prequant))
    want = fp8_linear_reference(x, layer.weight, layer.weight_scale, layer.input_scale)
    assert torch.equal(got, want), (got[0, :10], want[0, :10])


@pytest.mark.parametrize("regime,k", [("gemv", 2048), ("gemv", 2100), ("small", 2048)])
def test_every_candidate_config(regime, k):
    """Each config a GPU window times gives the reference's product: split-K by shape (N = 80 is one
    tile: 2 segments of 1024), K in whole steps (ALIGNED, N = 80 aside) or not."""
    gen = torch.Generator().manual_seed(k)
    layer = _layer(gen, 80, k, True, torch.bfloat16)
    x = (torch.randn(5 if regime == "gemv" else 37, k, generator=gen) * 2).to(torch.bfloat16)
    for config in CANDIDATES[regime]:
        _check(x, layer, config)


@pytest.mark.parametrize("split_k,k", [(3, 700), (4, 700), (64, 300), (2, 4096)])
def test_split_k_segments(split_k, k):
    """Segments of whole K steps: 700 = 6 steps of 128 as 3 x 2 (split 3 or 4: 3 segments hold a
    step), more splits than steps (one per step), an ALIGNED even split; fp32 partials reduced in
    order, against the reference at fp32's tolerance."""
    gen = torch.Generator().manual_seed(split_k + k)
    layer = _layer(gen, 48, k, True, torch.float32)
    x = torch.randn(19, k, generator=gen) * 2
    _check(x, layer, FP8Config(split_k=split_k, row_groups=2))


def test_a_rows_bits_do_not_depend_on_the_other_rows(monkeypatch):
    """A row alone (M = 1: gemv, x quantized in the GEMM) and in batches of 20 / 37 / 64 (small:
    2 or 4 row groups, x quantized first), at other places in its group, with other neighbours:
    the same bits, split-K (N = 48, K = 2048: 2 segments) included. Given a dot whose element
    depends on its own row and column only, as on a GPU: under the interpreter on `rowwise_dot`
    (tests/ops/conftest.py; numpy's BLAS gives a column other last bits by its place in the tile).
    The check sees a K order that would change with M: one split more changes the row's bits."""
    if DEVICE == "cpu":
        rowwise_dot(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    layer = _layer(gen, 48, 2048, True, torch.float32)
    x = torch.randn(64, 2048, generator=gen)
    assert choose_config(1, 48, 2048).split_k == 2 and choose_config(64, 48, 2048).row_groups == 4
    alone = _run(x[5:6], layer)
    for m in (20, 37, 64):
        assert torch.equal(_run(x[:m], layer)[5:6], alone), m
    assert torch.equal(_run(torch.cat([-x[:20], x[5:6]]), layer)[20:], alone)  # row 4 of its second group
    assert torch.equal(_run(x, layer)[50:51], _run(x[50:51], layer))
    assert not torch.equal(_run(x[5:6], layer, FP8Config(split_k=3)), alone)


def test_config_choice_depends_on_n_and_k_for_a_rows_arithmetic():
    """block_k and split_k (a row's K order) from (N, K) only; M picks the regime and row groups."""
    for n, k in ((6144, 4096), (28672, 4096), (4096, 14336), (4096, 4096), (80, 2048), (16, 32)):
        orders = {(c.block_k, c.split_k) for c in (choose_config(m, n, k) for m in (1, 2, 16, 17, 33, 64, 65, 300))}
        assert len(orders) == 1, (n, k, orders)
    # Llama-3-8B: qkv 48 tiles of 128 -> 3 segments (144 programs); gate_up 224 tiles unsplit;
    # down 32 tiles -> 5 segments of 2944; o_proj 32 tiles, K = 4096 -> 4 segments of 1024
    assert [fp8_linear.split_k_for(n, k) for n, k in ((6144, 4096), (28672, 4096), (4096, 14336), (4096, 4096))] \
        == [3, 1, 5, 4]
    assert [choose_config(m, 4096, 4096).row_groups for m in (1, 16, 17, 32, 33, 64, 65)] == [1, 1, 2, 2, 4, 4, 4]
    assert choose_config(1, 4096, 4096) == FP8Config(128, 128, 4, 1, 8, 4, False)
    assert choose_config(64, 4096, 4096) == FP8Config(64, 128, 4, 4, 4, 4, True)
    assert fp8_linear.resolve(FP8Config(split_k=8), 16, 300).split_k == 3  # one segment per step at most
    for bad in (dict(block_n=32), dict(block_k=64), dict(split_k=0), dict(row_groups=3), dict(num_warps=2),
                dict(num_stages=1)):
        with pytest.raises(ConfigError, match="FP8Config"):
            FP8Config(**bad)


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
    empty = torch.empty(3, 0, dtype=FP8_DTYPE, device=DEVICE)  # K = 0: an empty sum, the bias alone
    bias = torch.tensor([1.0, -2.0, 3.0], device=DEVICE)
    got = fp8_linear.fp8_linear(torch.ones(2, 0, device=DEVICE), empty, ws.to(DEVICE), xs.to(DEVICE), bias)
    assert torch.equal(got.cpu(), bias.cpu().expand(2, 3))


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


COMPILE_SCRIPT = """
import json, subprocess, sys
from pathlib import Path
from peagle_trt.ops.triton_kernels import aot
out = Path(sys.argv[1])
entries = aot.build(out / "gemm", only="fp8_linear.bf16", jit_only=True)
entries += aot.build(out / "elementwise", only="fp8_linear_", jit_only=True)
sass = {}
for e in entries:
    if e["variant"] in sys.argv[2:]:
        text = subprocess.run([str(aot.cuobjdump()), "-sass", str(out / "gemm" / e["file"])], capture_output=True,
                              text=True, check=True).stdout
        sass[f"{e['variant']} sm{e['arch']}"] = text
print(json.dumps({"entries": entries, "sass": sass}))
"""


@pytest.mark.skipif(other_triton() is not None, reason=str(other_triton()))
def test_fp8_linear_compiles_for_sm90a_and_sm100a_without_spills(tmp_path):
    """`aot.build(jit_only=True)`: every config of CANDIDATES (bf16; split-K and unsplit), the quantize
    and reduce kernels as real cubins, resources checked (no spills, <= 255 registers). The SASS of
    the defaults and of the FP8-MMA candidates: tensor-core MMAs (sm_90a wgmma: HGMMA 64x16x16 f16,
    QGMMA 64x16x32 e4m3; sm_100a tcgen05) and the weight streamed by cp.async (LDGSTS, 8 or 16
    bytes a copy), no 1-byte loads (the old kernel's `tl.where` pointers hid their contiguity:
    16-128 LDG.U8 per thread per K step)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from peagle_trt.ops.triton_kernels import aot, variants

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(repo), TRITON_DEFAULT_FP_FUSION="1")
    checked = [variants._fp8_linear("bf16", CANDIDATES[r][i], False).name for r in ("gemv", "small") for i in (0, 1)]
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, str(tmp_path), *checked], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    names = {e["variant"] for e in result["entries"]}
    assert {v.name for v in variants.fp8_variants("bf16")} <= names  # (and the f16 quantize / reduce)
    assert all(e["local"] == 0 and e["stack"] <= aot.STACK_LIMIT and e["registers"] <= 255
               for e in result["entries"])
    assert len(result["sass"]) == 2 * len(checked)
    for key, sass in result["sass"].items():
        fp8, sm90 = ".f8 " in key, key.endswith("sm90")
        mma = ("QGMMA.64x16x32.F32.E4M3.E4M3" if fp8 else "HGMMA.64x16x16.F32") if sm90 else \
            ("UTCQMMA" if fp8 else "UTCHMMA")
        assert mma in sass and "LDGSTS.E" in sass and "LDG.E.U8" not in sass, key
        if fp8 or not sm90:  # the FP8 MMA reads the tile where cp.async put it: 16-byte copies
            assert "LDGSTS.E.BYPASS.128" in sass, key


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
