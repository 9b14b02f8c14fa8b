"""FP8 (ModelOpt) Qwen3-MoE: ModelOpt quantizes attention and every expert (routers stay
unquantized) into per-expert FP8 linears that our loader reads; our forward reproduces ModelOpt's
fake-quantized HF model, and speculative output over the FP8 target equals its own greedy output."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt is not installed")

from peagle_trt.checkpoint.target import load_target  # noqa: E402
from peagle_trt.models.fp8 import fp8_layers  # noqa: E402
from peagle_trt.quantize import QuantSpec, calibrate, quantize_target  # noqa: E402
from peagle_trt.speculative.generate import generate  # noqa: E402
from tests.helpers import greedy, make_decoder  # noqa: E402
from tests.quantize.test_fp8 import build, hf, ours  # noqa: E402

SPEC = QuantSpec(num_calib=4, max_calib_len=64)


@pytest.fixture(scope="module")
def fp8_moe(tiny_moe, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "qwen3_moe-fp8"
    quantize_target(tiny_moe["qwen3_moe"], out, SPEC, progress=None)
    return out


def test_experts_and_attention_are_fp8_routers_are_not(fp8_moe):
    tensors = load_target(fp8_moe).tensors
    model = build(fp8_moe)
    names = set(fp8_layers(model))
    assert "layers.1.mlp.experts.7.down_proj" in names and "layers.1.self_attn.q_proj" in names
    assert "layers.0.mlp.gate_proj" in names  # dense layer (mlp_only_layers)
    assert tensors["layers.1.mlp.gate.weight"].dtype == torch.float32  # router kept in full precision
    assert len(names) == 8 * 4 + 6 * 8 * 3 + 2 * 3  # attention q k v o, experts, dense MLPs


def test_loader_reproduces_modelopt_fake_quant(fp8_moe, tiny_moe, monkeypatch):
    """Same check as for the dense families (tests/quantize/test_fp8.py): with ModelOpt's quantizer
    in the division form our FP8 forward is the same numbers."""
    from modelopt.torch.quantization import tensor_quant

    if not hasattr(tensor_quant, "_fp8_eager"):
        pytest.skip("this modelopt has no eager FP8 fake-quant to switch")
    modelopt_model, _ = calibrate(tiny_moe["qwen3_moe"], SPEC, progress=None)

    def division_form(x, amax=None):
        scale = amax.float() / 448.0
        return ((x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)

    monkeypatch.setattr(tensor_quant, "_fp8_eager", division_form)
    model = build(fp8_moe)
    for ids in ([7, 8, 9, 100, 200, 300], torch.randint(0, 500, (40,)).tolist()):
        ref, got = hf(modelopt_model, ids), ours(model, ids)
        assert (ref - got).abs().max() < 1e-5 * ref.abs().max()
        assert torch.equal(ref.argmax(-1), got.argmax(-1))


def test_speculative_equals_fp8_greedy(fp8_moe, tiny_moe):
    models = {"fp8": fp8_moe, "head": tiny_moe["drafter-qwen3_moe"]}
    prompt = [7, 8, 9, 100, 200, 300]
    plain = generate(make_decoder(models, "fp8", None, "none", 1, max_len=128), prompt, greedy(24)).output
    for mode in ("peagle", "eagle3"):
        spec = generate(make_decoder(models, "fp8", "head", mode, 3, max_len=128), prompt, greedy(24))
        assert spec.output == plain and len(plain) == 24
