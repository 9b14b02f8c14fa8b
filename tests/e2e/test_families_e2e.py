"""Qwen3-MoE, GPT-OSS and Gemma-4 end to end: greedy speculative output near-equals transformers'
greedy `generate` in every spec mode (torch backend; identical, or parting at a near-tie of
transformers' logits: tests/export/crossbackend.py); the exported graphs (attention sinks,
sliding windows, Gemma-4's per-layer head sizes and KV-shared layers, the PEagleMoE node, FP8
experts) equal the torch reference in onnxruntime within a tolerance, greedy generation there is
identical to target-only decoding in every mode (deterministic mode), and chunked prefill
near-equals torch's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from peagle_trt.checkpoint import load_pair
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.executors.onnxruntime import OrtExecutor
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.export import ExportOptions, export_models
from peagle_trt.runtime.scheduler import generate
from peagle_trt.speculative.decoder import SpecDecoder
from tests.export.crossbackend import check_greedy_near_equal, check_greedy_streams, hf_teacher_forced_logits
from tests.helpers import new_sequence, static_tables

FAMILIES = ["qwen3_moe", "gpt_oss", "gemma4", "gemma4_moe"]
K, SLOTS, SEQ = 3, 2, 96
MAX_ROWS = 20  # the export's sliding layers keep a ring of 8 + 20 - 1 positions (< SEQ)
MODES = ["none", "eagle3", "peagle"]
NEAR_TIE = 1e-3  # logits, ours against transformers (fp32 both, different kernels)
LOGIT_TOL = 1e-4  # torch against onnxruntime, as test_ort_target_matches_torch
MIN_AGREED = 8


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (5, 19)]  # 19 > window 8


def _models(tiny_moe, family: str, mode: str = "peagle"):
    pair = load_pair(tiny_moe[family], tiny_moe[f"drafter-{family}"], SpecConfig(mode, K))
    return pair.build()


@pytest.fixture(scope="module")
def exported(tiny_moe, tmp_path_factory):
    cache = {}

    def get(family: str):
        if family not in cache:
            target, drafter = _models(tiny_moe, family)
            out = tmp_path_factory.mktemp("export") / family
            export_models(target, drafter, out, ExportOptions(SpecConfig("peagle", K), SLOTS, SEQ, max_rows=MAX_ROWS))
            cache[family] = (target, drafter, out)
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_near_equals_transformers_generate(tiny_moe, family):
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe[family], dtype=torch.float32).eval()
    target, drafter = _models(tiny_moe, family)
    for prompt in _prompts():
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=30, min_new_tokens=30, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
        logits = hf_teacher_forced_logits(hf, prompt, ref)  # [30, V]
        for mode in MODES:
            spec = SpecConfig(mode, K)
            ex = TorchExecutor(target, drafter if mode != "none" else None, 1, SEQ + K + 1)
            out = generate(SpecDecoder(ex, spec), prompt, SamplingParams(max_tokens=30, ignore_eos=True))
            assert len(out.output) == 30, (family, mode, len(prompt))
            check_greedy_streams(logits, ref, out.output, NEAR_TIE, MIN_AGREED)


@pytest.mark.parametrize("family", FAMILIES)
def test_ort_target_matches_torch(exported, family):
    target, _, out = exported(family)
    torch_ex, ort_ex = TorchExecutor(target, None, SLOTS, SEQ + K + 1), OrtExecutor(out)
    slots = static_tables(ort_ex, [1, 0])
    steps = [(torch.randint(0, 500, (2, 13)), torch.tensor([list(range(13)), list(range(9)) + [-1] * 4])),
             (torch.randint(0, 500, (2, 1)), torch.tensor([[13], [9]])),
             (torch.randint(0, 500, (2, K + 1)), torch.tensor([list(range(14, 18)), list(range(10, 14))]))]
    for tokens, positions in steps:
        a_logits, a_aux = torch_ex.target(tokens, positions, slots)
        b_logits, b_aux = ort_ex.target(tokens, positions, slots)
        valid = positions >= 0
        torch.testing.assert_close(b_logits[valid], a_logits[valid], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b_aux[valid], a_aux[valid], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_ort_greedy_identical_to_target_only_in_every_mode(exported, family):
    _, _, out = exported(family)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in _prompts():
        outputs = {mode: generate(SpecDecoder(OrtExecutor(out, deterministic=True), SpecConfig(mode, K)), prompt,
                                  params, prefill_chunk=MAX_ROWS).output
                   for mode in MODES}
        assert outputs["eagle3"] == outputs["none"] and outputs["peagle"] == outputs["none"]


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4"])
def test_ort_chunked_prefill_across_the_window(exported, family):
    target, drafter, out = exported(family)
    prompt = list(range(200, 237))
    outputs = []
    for ex in (TorchExecutor(target, drafter, SLOTS, SEQ + K + 1), OrtExecutor(out)):
        decoder = SpecDecoder(ex, SpecConfig("peagle", K))
        seq = new_sequence(decoder, prompt, SamplingParams(max_tokens=16, ignore_eos=True))
        while not seq.prefilled:
            decoder.prefill([seq], chunk=10)
        while not seq.finished:
            decoder.step([seq])
        outputs.append(seq.output)
    assert len(outputs[0]) == len(outputs[1]) == 16
    check_greedy_near_equal(lambda: TorchExecutor(target, None, 1, SEQ + K + 1), lambda: OrtExecutor(out),
                            prompt, outputs[0], outputs[1], LOGIT_TOL, MIN_AGREED)


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_graph_is_static_with_sinks_and_windows_on_the_nodes(exported, family):
    import onnx

    from peagle_trt.ops import DOMAIN
    from peagle_trt.ops.onnx_defs import register_schemas

    register_schemas()
    _, _, out = exported(family)
    onnx.checker.check_model(str(out / "target.onnx"), full_check=True)
    model = onnx.load(str(out / "target.onnx"), load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    assert not ops & {"Loop", "Scan", "If"}  # no per-token control flow
    assert sum(n.op_type == "PEagleMoE" for n in model.graph.node) == {"qwen3_moe": 6, "gpt_oss": 8,
                                                                         "gemma4": 0, "gemma4_moe": 8}[family]
    attn = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == "PEagleKVAttention"]
    windows = [next((a.i for a in n.attribute if a.name == "sliding_window"), 0) for n in attn]
    if family == "gpt_oss":
        assert windows == [8, 0] * 4 and all(len(n.input) == 8 for n in attn)  # + sinks input
        blocks = [i.type.tensor_type.shape.dim[0].dim_value - 1 for i in model.graph.input
                  if i.name.startswith("past_key")]
        # full layers: SLOTS requests x ceil((SEQ + K + 1) / 32) blocks; windowed layers: SLOTS x
        # (ceil((8 + MAX_ROWS) / 32) + 1) blocks of their own (+ the trash block each)
        assert blocks == [SLOTS * 2, SLOTS * 4] * 4
    elif family.startswith("gemma4"):  # layers 5-7 read the caches of 2, 4, 2: no KV inputs of their own
        assert windows == [8, 8, 0, 8, 8, 0, 8, 0] and all(len(n.input) == 7 for n in attn)
        assert [(next(a.i for a in n.attribute if a.name == "num_kv_heads"),
                 next(a.i for a in n.attribute if a.name == "head_dim")) for n in attn] == \
            [(2, 32), (2, 32), (1, 64), (2, 32), (2, 32), (1, 64), (2, 32), (1, 64)] and \
            {a.f for n in attn for a in n.attribute if a.name == "scale"} == {1.0}
        kv = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input
              if i.name.startswith("past_key")}
        sliding, full = [SLOTS * 2 + 1, 32, 2, 32], [SLOTS * 4 + 1, 32, 1, 64]
        assert kv == {f"past_key_{i}": shape for i, shape in enumerate([sliding, sliding, full, sliding, sliding])}
        from peagle_trt.engine.build import _graph_info
        from peagle_trt.errors import BuildError

        with pytest.raises(BuildError, match=r"sliding windows.*KV-shared layers"):  # TensorRT refuses both
            _graph_info(out / "trt" / "target.onnx")
    else:  # full attention: + an empty sinks slot and the draft-tree mask
        assert windows == [0] * 8 and all(list(n.input[7:]) == ["", "tree_mask"] for n in attn)


FP8_TOL = 5e-2  # logits, torch against onnxruntime with FP8 activations (tests/export/crossbackend.py)


@pytest.mark.parametrize("family, kind, static", [("qwen3_moe", "channel", False), ("gpt_oss", "tensor", True)])
def test_fp8_experts_export_and_decode(tiny_moe, tmp_path, family, kind, static):
    """FP8 experts (peagle_trt/models/moe.py `quantize_experts`) export with their scales; onnxruntime
    near-equals torch (greedy, with margins) and speculates exactly as it decodes alone, on both."""
    from peagle_trt.models.moe import SparseMoE, quantize_experts

    target, drafter = _models(tiny_moe, family)
    for m in target.modules():
        if isinstance(m, SparseMoE):
            quantize_experts(m, kind, act_scale=4.0 if static else None)
    out = tmp_path / "export"
    export_models(target, drafter, out, ExportOptions(SpecConfig("peagle", K), SLOTS, SEQ, max_rows=MAX_ROWS))
    prompt, params = _prompts()[1], SamplingParams(max_tokens=20, ignore_eos=True)
    made = {"torch": lambda: TorchExecutor(target, drafter, 1, SEQ + K + 1, deterministic=True),
            "ort": lambda: OrtExecutor(out, deterministic=True)}
    outputs = {}
    for backend, make in made.items():
        runs = {mode: generate(SpecDecoder(make(), SpecConfig(mode, K)), prompt, params, prefill_chunk=MAX_ROWS).output
                for mode in MODES}
        assert runs["eagle3"] == runs["none"] and runs["peagle"] == runs["none"], backend
        outputs[backend] = runs["none"]
    check_greedy_near_equal(lambda: TorchExecutor(target, None, 1, SEQ + K + 1), lambda: OrtExecutor(out),
                            prompt, outputs["torch"], outputs["ort"], FP8_TOL, MIN_AGREED)


def test_build_prints_and_records_kv_memory(tiny_moe, tmp_path, capsys):
    from peagle_trt.build import RepositoryOptions, build_repository

    manifest = build_repository(tiny_moe["gpt_oss"], tiny_moe["drafter-gpt_oss"], tmp_path / "repo",
                                RepositoryOptions(SpecConfig("peagle", K), max_batch=4, max_seq_len=60,
                                                  prefill_chunk=8))
    mem = manifest["kv_memory"]
    assert (mem["full_layers"], mem["windowed_layers"], mem["num_blocks"]) == (4, 4, 4 * 2)  # 4 x 64 positions
    block = 2 * 2 * 32 * 32 * 4  # K and V, 2 kv heads, 32 positions, head_dim 32, fp32
    # windowed layers: 4 requests x (ceil((8 + 8) / 32) + 1) blocks, + the trash block
    assert mem["target_bytes_per_block"] == 4 * block and mem["window_bytes"] == 4 * block * (4 * 2 + 1)
    assert "KV cache: 8 blocks x 32 positions" in capsys.readouterr().err
