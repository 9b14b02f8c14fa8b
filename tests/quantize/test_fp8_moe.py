"""FP8 (ModelOpt) targets of the P-EAGLE families: ModelOpt quantizes attention and the experts
(routers stay unquantized). Qwen3-MoE comes out as per-expert FP8 linears (stacked on load), GPT-OSS
as stacked FP8 expert tensors with one scale pair per projection, Gemma-4 as FP8 attention / MLP / per-layer-input
linears (KV-shared layers have no k/v) and, with the MoE block, per-expert FP8 linears; our loader
reads them, reproduces ModelOpt's
fake-quantized HF model, and speculative output over the FP8 target equals its own greedy output."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt is not installed")

from peagle_trt.checkpoint.target import load_target  # noqa: E402
from peagle_trt.models.fp8 import fp8_layers  # noqa: E402
from peagle_trt.models.moe import fp8_experts  # noqa: E402
from peagle_trt.quantize import QuantizeOptions, calibrate, quantize_target  # noqa: E402
from peagle_trt.runtime.scheduler import generate  # noqa: E402
from tests.helpers import greedy, make_decoder  # noqa: E402
from tests.quantize.test_fp8 import build, hf, ours  # noqa: E402

SPEC = QuantizeOptions(num_calib=4, max_calib_len=64)
FAMILIES = ["qwen3_moe", "gpt_oss"]
ALL = FAMILIES + ["gemma4", "gemma4_moe"]
# FP8 linears: qwen3_moe 8 layers x 4 attention + 6 sparse layers x 8 experts x 3 + 2 dense x 3;
# gpt_oss 8 layers x (4 attention + 8 experts x 3)
FP8_LAYERS = {"qwen3_moe": 8 * 4 + 2 * 3, "gpt_oss": 8 * 4}
# FP8 stacked experts (peagle_trt/models/moe.py): one per sparse layer
FP8_EXPERTS = {"qwen3_moe": 6, "gpt_oss": 8}


@pytest.fixture(scope="module")
def fp8_moe(tiny_moe, tmp_path_factory):
    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = tmp_path_factory.mktemp("fp8") / f"{family}-fp8"
            quantize_target(tiny_moe[family], cache[family], SPEC, progress=None)
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_and_attention_are_fp8_routers_are_not(fp8_moe, family):
    path = fp8_moe(family)
    model = build(path)
    names, experts = set(fp8_layers(model)), fp8_experts(model)
    assert "layers.1.mlp.experts" in experts and "layers.1.self_attn.q_proj" in names
    assert len(names) == FP8_LAYERS[family] and len(experts) == FP8_EXPERTS[family]
    ex = experts["layers.1.mlp.experts"]  # ModelOpt's static per-expert scales, per channel where gate != up
    assert ex.down_proj_scale.shape == ex.down_proj_input_scale.shape == (8,)
    assert load_target(path).tensors["layers.1.mlp.gate.weight"].dtype == torch.float32  # router


def test_gemma4_attention_mlp_and_per_layer_inputs_are_fp8(fp8_moe):
    names = set(fp8_layers(build(fp8_moe("gemma4"))))
    # 4 sliding owners x (q k v o + 3 MLP + 2 per-layer-input) + the k_eq_v full layer 2 (no v_proj)
    # + 3 KV-shared layers (no k / v) + the per-layer model projection; embeddings stay unquantized
    assert len(names) == 4 * 9 + 8 + 3 * 7 + 1
    assert {"layers.2.self_attn.k_proj", "layers.5.self_attn.q_proj", "layers.0.per_layer_input_gate",
            "per_layer_inputs.per_layer_model_projection"} <= names
    assert "layers.5.self_attn.k_proj" not in names and "layers.2.self_attn.v_proj" not in names
    tensors = load_target(fp8_moe("gemma4")).tensors
    assert tensors["per_layer_inputs.embed_tokens_per_layer.weight"].dtype == torch.float32


def test_gemma4_moe_experts_are_fp8_router_is_not(fp8_moe):
    path = fp8_moe("gemma4_moe")
    model = build(path)
    names, experts = set(fp8_layers(model)), fp8_experts(model)
    assert len(names) == 4 * 9 + 8 + 3 * 7 + 1  # the dense Gemma-4 count
    assert len(experts) == 8 and "layers.3.moe.experts" in experts and "layers.3.moe.gate" not in names
    assert load_target(path).tensors["layers.3.moe.gate.weight"].dtype == torch.float32


@pytest.mark.parametrize("family", ALL)
def test_loader_reproduces_modelopt_fake_quant(fp8_moe, tiny_moe, family, monkeypatch):
    """As for the dense families (tests/quantize/test_fp8.py): with ModelOpt's quantizer in the
    division form our FP8 forward is the same numbers, position by position, where no activation
    sits on an E4M3 rounding boundary. The MoE op sums a row's picks in pick order, transformers in
    expert order; from that last-bit difference a boundary activation can take the other code, which
    moves a few positions (those attending to it through a window) and leaves the rest equal (seen
    at 1 thread on the fixed 40-token prompt: positions 3 and 9-16). A misread scale moves every
    position: at least 3 in 4 positions must agree to float32 rounding."""
    from modelopt.torch.quantization import tensor_quant

    if not hasattr(tensor_quant, "_fp8_eager"):
        pytest.skip("this modelopt has no eager FP8 fake-quant to switch")
    model = build(fp8_moe(family))
    modelopt_model, _ = calibrate(tiny_moe[family], SPEC, progress=None)

    def division_form(x, amax=None):
        scale = amax.float() / 448.0
        return ((x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)

    monkeypatch.setattr(tensor_quant, "_fp8_eager", division_form)
    prompt = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    for ids in ([7, 8, 9, 100, 200, 300], prompt):
        ref, got = hf(modelopt_model, ids), ours(model, ids)
        equal = (ref - got).abs().amax(dim=-1) < 1e-5 * ref.abs().max()  # [positions]
        assert equal.float().mean() >= 0.75, equal.tolist()
        assert torch.equal(ref.argmax(-1)[equal], got.argmax(-1)[equal])


@pytest.mark.parametrize("family", ALL)
def test_speculative_equals_fp8_greedy(fp8_moe, tiny_moe, family):
    models = {"fp8": fp8_moe(family), "head": tiny_moe[f"drafter-{family}"]}
    prompt = [7, 8, 9, 100, 200, 300, 5, 6, 7, 8, 9, 10]  # 12 > GPT-OSS's / Gemma-4's window of 8
    plain = generate(make_decoder(models, "fp8", None, "none", 1, max_len=128), prompt, greedy(24)).output
    for mode in ("peagle", "eagle3"):
        spec = generate(make_decoder(models, "fp8", "head", mode, 3, max_len=128), prompt, greedy(24))
        assert spec.output == plain and len(plain) == 24


@pytest.mark.slow
def test_mxfp4_checkpoint_requantizes_to_fp8(tiny_moe, tmp_path):
    """The released GPT-OSS layout (MXFP4 experts) goes through `quantize` (transformers
    dequantizes it for ModelOpt) into FP8 that our loader serves, speculation exact."""
    out = tmp_path / "gpt_oss_mxfp4-fp8"
    quantize_target(tiny_moe["gpt_oss_mxfp4"], out, SPEC, progress=None)
    model = build(out)
    assert len(fp8_layers(model)) == FP8_LAYERS["gpt_oss"] and len(fp8_experts(model)) == FP8_EXPERTS["gpt_oss"]
    models = {"fp8": out, "head": tiny_moe["drafter-gpt_oss"]}
    prompt = list(range(30, 45))
    plain = generate(make_decoder(models, "fp8", None, "none", 1, max_len=96), prompt, greedy(16)).output
    spec = generate(make_decoder(models, "fp8", "head", "peagle", 3, max_len=96), prompt, greedy(16))
    assert spec.output == plain
