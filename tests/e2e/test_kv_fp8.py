"""FP8 (E4M3) KV caches through the executors (`--kv-cache-dtype fp8`, KVLayout.cache_dtype): the
hard gate holds on each backend (speculative == target-only, every spec mode, deterministic mode),
torch and onnxruntime agree within a stated margin (tests/export/crossbackend.py), the export
carries the choice (uint8 E4M3 caches for onnxruntime, float8e4m3fn in the TensorRT copy, the
scales as attributes), a ModelOpt checkpoint's calibrated k_scale / v_scale are the ones used, and
the KV memory accounting quarters (float32) or halves (16-bit)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from peagle_trt.checkpoint import load_pair
from peagle_trt.config import KVLayout, SamplingParams, SpecConfig
from peagle_trt.executors.onnxruntime import OrtExecutor
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.export import ExportOptions, export_models
from peagle_trt.runtime.scheduler import generate
from peagle_trt.speculative.decoder import SpecDecoder
from tests.export.crossbackend import check_greedy_near_equal

FP8 = torch.float8_e4m3fn
K, SEQ = 3, 96
PROMPTS = ([5, 9, 13], list(range(7, 30)))
MODES = {"eagle3": SpecConfig("eagle3", K), "peagle": SpecConfig("peagle", K),
         "tree": SpecConfig("peagle", K, tree_budget=5)}
# |logit| error bound torch vs onnxruntime, both with FP8 caches. Both store the same codes where their
# float32 k / v agree to the bit (most prompts: errors ~2e-6, as float32 caches); a last-bit difference
# that crosses an E4M3 rounding boundary moves one cached element by a step (1/8 of its binade): measured
# max 1.1e-3 over 12 random prompts of 1-50 tokens, 40 tokens each (tiny llama, 2026-11-28).
FP8_KV_LOGIT_TOL = 1e-2


def fp8_layout(slots: int = 1) -> KVLayout:
    return KVLayout.for_sequences(slots, SEQ + 2 * K + 2, max_rows=SEQ, cache_dtype="fp8")


@pytest.fixture(scope="module")
def pair(tiny):
    spec = SpecConfig("peagle", K)
    return load_pair(tiny["llama"], tiny["aws"], spec).build()


@pytest.fixture(scope="module")
def fp8_export(pair, tmp_path_factory):
    target, drafter = pair
    out = tmp_path_factory.mktemp("fp8kv") / "export"
    export_models(target, drafter, out, ExportOptions(SpecConfig("peagle", K), 1, SEQ, kv_cache_dtype="fp8"))
    return out


def _executor(backend: str, target, drafter, spec: SpecConfig):
    if backend == "torch":
        return TorchExecutor(target, drafter, fp8_layout(), deterministic=True)
    return OrtExecutor.from_models(target, drafter, spec, fp8_layout(), deterministic=True)


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_speculative_equals_target_only_with_fp8_caches(pair, backend, mode):
    """The hard gate with the caches in FP8, target's and drafter's: a verify writes K + 1 rows at once
    where target-only decoding writes one, and each key is stored once by the same rule."""
    target, drafter = pair
    spec, params = MODES[mode], SamplingParams(max_tokens=20, ignore_eos=True)
    ex = _executor(backend, target, drafter, spec)
    if backend == "torch":
        assert ex.target_cache.k[0].dtype == FP8 and ex.drafter_cache.v[-1].dtype == FP8
    else:
        graphs = [g for g in (ex.g_target, ex.g_drafter, ex.g_step) if g is not None]
        assert {a.dtype for g in graphs for a in g.kv.values()} == {np.dtype(np.uint8)}  # E4M3 bit patterns
    plain = _executor(backend, target, None, SpecConfig("none", K))
    for prompt in PROMPTS:
        spec_run = generate(SpecDecoder(ex, spec), prompt, params)
        assert spec_run.output == generate(SpecDecoder(plain, SpecConfig("none", K)), prompt, params).output
        assert spec_run.stats.drafter_forwards > 0


def test_fp8_caches_near_equal_across_torch_and_onnxruntime(pair, fp8_export):
    """torch (reference ops) and onnxruntime (the exported files, their manifest's FP8 layout) with FP8
    caches: logits within FP8_KV_LOGIT_TOL, greedy tokens equal wherever the margin allows."""
    target, drafter = pair
    spec, params = SpecConfig("peagle", K), SamplingParams(max_tokens=16, ignore_eos=True)
    assert OrtExecutor(fp8_export).kv.cache_dtype == "fp8"
    for prompt in PROMPTS:
        ref = generate(SpecDecoder(TorchExecutor(target, drafter, fp8_layout()), spec), prompt, params)
        got = generate(SpecDecoder(OrtExecutor(fp8_export), spec), prompt, params)
        check_greedy_near_equal(lambda: TorchExecutor(target, None, fp8_layout()), lambda: OrtExecutor(fp8_export),
                                prompt, ref.output, got.output, FP8_KV_LOGIT_TOL)


def test_the_export_carries_fp8_caches(fp8_export):
    """onnxruntime's graphs: uint8 caches (E4M3 bit patterns) and a body that encodes / decodes; the
    TensorRT copies: the same caches as float8e4m3fn, the nodes' k_scale / v_scale attributes kept."""
    from peagle_trt.ops.names import KV_ATTENTION
    from peagle_trt.ops.onnx_defs import register_schemas

    register_schemas()
    manifest = json.loads((fp8_export / "manifest.json").read_text())
    assert manifest["export"]["kv"]["cache_dtype"] == "fp8" and manifest["export"]["kv_cache_dtype"] == "fp8"
    for graph in ("target", "drafter", "drafter_step"):
        model = onnx.load(str(fp8_export / f"{graph}.onnx"))
        onnx.checker.check_model(model, full_check=True)
        caches = [v for v in (*model.graph.input, *model.graph.output) if v.name.startswith(("past_", "present_"))]
        assert caches and {v.type.tensor_type.elem_type for v in caches} == {onnx.TensorProto.UINT8}
        trt = onnx.load(str(fp8_export / "trt" / f"{graph}.onnx"), load_external_data=False)
        trt_caches = [v for v in (*trt.graph.input, *trt.graph.output) if v.name.startswith(("past_", "present_"))]
        assert {v.type.tensor_type.elem_type for v in trt_caches} == {onnx.TensorProto.FLOAT8E4M3FN}
        nodes = [n for n in trt.graph.node if n.op_type == KV_ATTENTION]
        scales = {(a.name, a.f) for n in nodes for a in n.attribute if a.name in ("k_scale", "v_scale")}
        assert nodes and scales == {("k_scale", 1.0), ("v_scale", 1.0)}  # no calibrated scales: vLLM's 1.0


def test_a_calibrated_checkpoints_scales_are_used(tiny, tmp_path):
    """A ModelOpt FP8 checkpoint with KV scales (quantize --kv-cache-fp8): each layer's cache stores and
    reads with its k_proj.k_scale / v_proj.v_scale, in torch and in the exported nodes alike."""
    pytest.importorskip("modelopt")
    from peagle_trt.export.graphs import export_target
    from peagle_trt.ops.names import KV_ATTENTION
    from peagle_trt.quantize import QuantizeOptions, quantize_target

    quantize_target(tiny["llama"], tmp_path / "fp8", QuantizeOptions(kv_cache_fp8=True, num_calib=2))
    target, _ = load_pair(tmp_path / "fp8", None, SpecConfig("none", 1)).build()
    calibrated = [(float(layer.self_attn.k_proj.kv_scale), float(layer.self_attn.v_proj.kv_scale))
                  for layer in target.layers]
    assert all(s != 1.0 for pair in calibrated for s in pair)
    cache = target.new_cache(fp8_layout())
    assert list(zip(cache.k_scale, cache.v_scale)) == calibrated
    nodes = [n for n in export_target(target, fp8_layout()).graph.node if n.op_type == KV_ATTENTION]
    attrs = [tuple(next(a.f for a in n.attribute if a.name == name) for name in ("k_scale", "v_scale"))
             for n in nodes]
    np.testing.assert_allclose(attrs, calibrated, rtol=1e-7)  # float32 attributes
    assert target.new_cache(KVLayout.for_sequences(1, 64)).k[0].dtype == torch.float32  # auto: unused there


def test_kv_memory_quarters_float32_and_halves_16_bit(tiny):
    from peagle_trt.models.memory import kv_memory

    target, drafter = (m.config for m in load_pair(tiny["llama"], tiny["aws"], SpecConfig("peagle", K)).build())
    layout = KVLayout.for_sequences(4, 256)
    fp8 = kv_memory(target, drafter, KVLayout.for_sequences(4, 256, cache_dtype="fp8"), 4)
    assert fp8.element_bytes == 1 and fp8.cache_dtype == "fp8" and "FP8" in fp8.describe()
    assert fp8.total_bytes * 4 == kv_memory(target, drafter, layout, 4).total_bytes
    assert fp8.total_bytes * 2 == kv_memory(target, drafter, layout, 2).total_bytes
    assert fp8.drafter_bytes_per_block * 4 == kv_memory(target, drafter, layout, 4).drafter_bytes_per_block
