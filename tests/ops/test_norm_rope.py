"""The Triton RMSNorm and RoPE (peagle_trt/ops/triton_kernels/norm_rope.py) against the models' references
(peagle_trt/models/layers.py `rms_norm`, `rope`), under the Triton interpreter (on a GPU with
PEAGLE_TRITON_DEVICE=cuda).

What it checks: rope equal to the reference to the bit (fp32 / fp16 / bf16; heads over one and several
head blocks; the strided q/k views the attention passes: a [B, S, H*d] projection viewed per head, and a
transposed one), rms_norm within rounding (rows of 1 .. 4096 wide, weight or none, a weight of another
dtype promoting like torch), and that routed through `ops.kernels` the models' names reach the kernels
only inside `routed()`/`enable()` (CPU: the reference stays).
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.conftest import DEVICE  # sets TRITON_INTERPRET=1 on CPU, before the kernels are imported

pytest.importorskip("triton", reason="pip install -c constraints.txt 'peagle-trt[dev]' (triton==3.9.0)")

from peagle_trt.models import layers  # noqa: E402
from peagle_trt.models.rope import rope_cos_sin  # noqa: E402
from peagle_trt.ops.triton_kernels import norm_rope  # noqa: E402

pytestmark = pytest.mark.kernels
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=1e-3),
       torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def _cos_sin(b, s, d, dtype, gen):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    positions = torch.randint(0, 4000, (b, s), generator=gen)
    return rope_cos_sin(inv, 1.0, positions, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,d", [(1, 16), (4, 64), (20, 128)])
def test_rope_is_the_reference_to_the_bit(dtype, heads, d):
    gen = torch.Generator().manual_seed(heads * d)
    b, s = 2, 3
    proj = (torch.randn(b, s, heads * d, generator=gen) * 3).to(dtype)  # a q/k projection's output
    cos, sin = _cos_sin(b, s, d, dtype, gen)
    want = layers.rope(proj.view(b, s, heads, d), cos, sin)
    got = norm_rope.rope(proj.to(DEVICE).view(b, s, heads, d), cos.to(DEVICE), sin.to(DEVICE)).cpu()
    assert got.shape == (b, s, heads * d) and got.dtype == dtype
    assert torch.equal(got, want)
    wide = torch.randn(b, heads, s, d, generator=gen).to(dtype)  # a strided view: [B, S, H, d] of [B, H, S, d]
    got = norm_rope.rope(wide.to(DEVICE).transpose(1, 2), cos.to(DEVICE), sin.to(DEVICE)).cpu()
    assert torch.equal(got, layers.rope(wide.transpose(1, 2), cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 24, 128, 4096])
@pytest.mark.parametrize("weighted", [False, True])
def test_rms_norm_matches_the_reference(dtype, n, weighted):
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(3, 5, n, generator=gen) * 4).to(dtype)
    w = (1 + torch.randn(n, generator=gen) * 0.1).to(dtype) if weighted else None
    want = layers.rms_norm(x, w, 1e-6)
    got = norm_rope.rms_norm(x.to(DEVICE), None if w is None else w.to(DEVICE), 1e-6).cpu()
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_rms_norm_weight_promotes_like_torch():
    x = torch.randn(2, 32).to(torch.bfloat16)
    w = torch.rand(32) + 0.5  # fp32 weight over bf16 activations: an fp32 result, as torch's product
    got = norm_rope.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5).cpu()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, layers.rms_norm(x, w, 1e-5), atol=1e-5, rtol=1e-5)


def test_bad_shapes_raise():
    x = torch.zeros(1, 2, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="cos / sin"):
        norm_rope.rope(x, torch.zeros(1, 2, 4, device=DEVICE), torch.zeros(1, 2, 4, device=DEVICE))
    with pytest.raises(ValueError, match="weight must be"):
        norm_rope.rms_norm(x, torch.ones(4, device=DEVICE), 1e-6)


def test_the_models_reach_the_kernels_only_when_routed():
    """The dispatchers `ops.kernels.install()` puts in peagle_trt/models/layers.py call the reference on
    CPU tensors outside routed()/enable(): installing them changes no result."""
    from peagle_trt.ops import kernels

    kernels.install()
    x = torch.randn(2, 3, 4, 16)
    cos, sin = _cos_sin(2, 3, 16, torch.float32, torch.Generator().manual_seed(0))
    assert layers.rms_norm is not norm_rope.rms_norm and layers.rms_norm.__name__ == "_rms_norm_dispatch"
    assert torch.equal(layers.RMSNorm(16, 1e-6)(x), kernels._original("peagle_trt.models.layers", "rms_norm")(
        x, torch.ones(16), 1e-6))
    assert torch.equal(layers.rope(x, cos, sin), kernels._original("peagle_trt.models.layers", "rope")(x, cos, sin))
