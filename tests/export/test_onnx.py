"""The exported graphs: plugin nodes with their attributes, valid schemas, TensorRT copies without
local functions; the onnxruntime executor is near the torch reference (logits and taps within a
tolerance, greedy tokens equal wherever the top-2 margin exceeds what the tolerance can flip:
tests/export/crossbackend.py) in every spec mode; within onnxruntime, speculative and chunked
decoding equal target-only decoding exactly."""

from __future__ import annotations

import onnx
import pytest
import torch

from peagle_trt.checkpoint import load_pair
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError
from peagle_trt.executors.onnxruntime import OrtExecutor
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.export import ExportOptions, export_models
from peagle_trt.ops import DOMAIN, OP_TYPES
from peagle_trt.ops.names import PLUGIN_VERSION
from peagle_trt.ops.onnx_defs import register_schemas
from peagle_trt.ops.reference import pack_tree_mask
from peagle_trt.runtime.scheduler import generate
from peagle_trt.speculative.decoder import SpecDecoder
from tests.export.crossbackend import check_greedy_near_equal, check_greedy_streams
from tests.helpers import new_sequence, static_tables

K, SLOTS, SEQ = 3, 3, 120
# |logit| error bound torch vs onnxruntime for the float32 graphs (measured: about 1e-6; see
# docs/EXPORT.md, "Cross-backend numerics").
LOGIT_TOL = 1e-4
PROMPTS = ([5], list(range(7, 30)), list(range(100, 160)))


@pytest.fixture(scope="module")
def exported(tiny, tmp_path_factory):
    """(torch models, export dir) per (family, mode)."""
    cache = {}

    def get(family: str, mode: str):
        key = (family, mode)
        if key not in cache:
            drafter = {"llama": "aws", "qwen3": "speculators"}[family]
            spec = SpecConfig(mode, K)
            pair = load_pair(tiny[family], tiny[drafter], spec)
            target, draft = pair.build()
            out = tmp_path_factory.mktemp("export") / f"{family}-{mode}"
            export_models(target, draft, out, ExportOptions(spec, SLOTS, SEQ))
            cache[key] = (target, draft, out, spec)
        return cache[key]

    return get


def test_graphs_hold_plugin_nodes_and_pass_the_full_checker(exported):
    register_schemas()
    _, _, out, _ = exported("llama", "peagle")
    expected = {"target.onnx": {"PEagleKVAttention": 8}, "drafter.onnx": {
        "PEagleKVAttention": 2, "PEagleDraftInputs": 1, "PEagleDraftSample": 1},
        "drafter_step.onnx": {"PEagleKVAttention": 2}}
    for name, counts in expected.items():
        onnx.checker.check_model(str(out / name), full_check=True)
        model = onnx.load(str(out / name))
        nodes = [n for n in model.graph.node if n.domain == DOMAIN]
        assert {t: sum(n.op_type == t for n in nodes) for t in counts} == counts
        for node in nodes:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attrs["plugin_version"] == PLUGIN_VERSION.encode() and attrs["plugin_namespace"] == b""
            if node.op_type == "PEagleKVAttention":
                assert (attrs["num_heads"], attrs["num_kv_heads"]) == ((4, 2) if name == "target.onnx" else (4, 2))
                assert attrs["head_dim"] in (32, 16) and attrs["scale"] == pytest.approx(attrs["head_dim"] ** -0.5)
            if node.op_type == "PEagleDraftInputs":
                assert attrs["num_spec_tokens"] == K and attrs["mask_token_id"] == 3
        assert {f.name for f in model.functions} == set(counts)  # reference bodies for onnxruntime
        trt = onnx.load(str(out / "trt" / name))
        assert len(trt.functions) == 0  # TensorRT resolves the plugins by op_type
        assert sum(n.domain == DOMAIN for n in trt.graph.node) == sum(counts.values())
        for node in (n for n in trt.graph.node if n.op_type == "PEagleKVAttention"):  # the plugin's inputs
            assert list(node.input[7:]) == (["tree_mask"] if name == "target.onnx" else []) and "" not in node.input
    assert all(t in OP_TYPES for t in ("PEagleKVAttention", "PEagleDraftInputs", "PEagleDraftSample"))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_ort_target_matches_torch_for_prefill_decode_and_verify(exported, family):
    target, _, out, _ = exported(family, "peagle")
    torch_ex, ort_ex = TorchExecutor(target, None, SLOTS, SEQ + K + 1), OrtExecutor(out)
    slots = static_tables(ort_ex, [2, 0])
    steps = [(torch.randint(0, 500, (2, 13)), torch.tensor([list(range(13)), list(range(9)) + [-1] * 4])),  # prefill
             (torch.randint(0, 500, (2, 1)), torch.tensor([[13], [9]])),  # decode
             (torch.randint(0, 500, (2, K + 1)), torch.tensor([list(range(14, 18)), list(range(10, 14))]))]  # verify
    for tokens, positions in steps:
        a_logits, a_aux = torch_ex.target(tokens, positions, slots)
        b_logits, b_aux = ort_ex.target(tokens, positions, slots)
        valid = positions >= 0
        torch.testing.assert_close(b_logits[valid], a_logits[valid], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b_aux[valid], a_aux[valid], rtol=1e-4, atol=1e-4)


def test_ort_tree_verify_matches_torch(exported):
    """A draft-tree verify (rows by depth, the packed ancestor mask) after a prefill: both backends
    agree, and the tree rows wrote the slots cur + row (the next plain decode reads them)."""
    target, _, out, _ = exported("llama", "peagle")
    torch_ex, ort_ex = TorchExecutor(target, None, SLOTS, SEQ + K + 1), OrtExecutor(out)
    slots = static_tables(ort_ex, [2, 0])
    trees = [(-1, -1, 0, 1, 0), (-1, 0)]
    mask = torch.from_numpy(pack_tree_mask(trees, 6))
    steps = [(torch.randint(0, 500, (2, 13)), torch.tensor([list(range(13)), list(range(9)) + [-1] * 4]), None),
             (torch.randint(0, 500, (2, 6)), torch.tensor([[13, 14, 14, 15, 15, 16], [9, 10, 11, -1, -1, -1]]), mask),
             (torch.randint(0, 500, (2, 1)), torch.tensor([[19], [12]]), None)]
    for tokens, positions, tree in steps:
        a_logits, a_aux = torch_ex.target(tokens, positions, slots, tree_mask=tree)
        b_logits, b_aux = ort_ex.target(tokens, positions, slots, tree_mask=tree)
        valid = positions >= 0
        torch.testing.assert_close(b_logits[valid], a_logits[valid], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b_aux[valid], a_aux[valid], rtol=1e-4, atol=1e-4)


def test_ort_parallel_drafts_equal_torch(exported):
    target, drafter, out, _ = exported("llama", "peagle")
    torch_ex = TorchExecutor(target, drafter, SLOTS, SEQ + K + 1)
    ort_ex = OrtExecutor(out)
    pending = torch.randint(0, 500, (2, 6))
    aux = torch.randn(2, 6, 192)
    n, cur, slots = torch.tensor([6, 2]), torch.tensor([30, 11]), static_tables(ort_ex, [1, 2])
    for k in (K, K, 1, K - 1):  # a pass after another reads its KV; k < K runs fewer mask rows
        a, a_logp = torch_ex.draft_parallel_top(pending, aux, n, cur, slots, k, 2)  # [2, k, 2] each
        b = ort_ex.draft_parallel(pending, aux, n, cur, slots, k)
        assert b.shape == (2, k)
        for row in range(2):  # ids equal, or parting at a near-tie of torch's log-probs (crossbackend.py)
            check_greedy_streams(a_logp[row], a[row, :, 0].tolist(), b[row].tolist(), 2 * LOGIT_TOL, min(k, 2))
        cur = cur + 2
    v_d = drafter.lm_head.weight.shape[0]  # a width past the draft vocabulary: all of it, ranked
    ids, logp = ort_ex.draft_parallel_top(pending, aux, n, cur, slots, K, v_d + 50)
    assert ids.shape == logp.shape == (2, K, v_d) and (logp[..., :-1] >= logp[..., 1:]).all()
    det = OrtExecutor(out, deterministic=True)  # row-invariant: k = 1 and K's first row computed alike
    first = det.draft_parallel(pending, aux, n, cur, slots, K)[:, :1]  # causal rows: k = 1 is K's first
    assert det.draft_parallel(pending, aux, n, cur, slots, 1).tolist() == first.tolist()
    for k in (0, K + 1):
        with pytest.raises(ConfigError, match="exported for K=3"):
            ort_ex.draft_parallel(pending, aux, n, cur, slots, k)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("mode", ["none", "eagle3", "peagle"])
def test_greedy_generation_near_equal_across_torch_and_onnxruntime(exported, family, mode):
    target, drafter, out, spec = exported(family, mode)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        ref = generate(SpecDecoder(TorchExecutor(target, drafter, SLOTS, SEQ + K + 1), spec), prompt, params)
        got = generate(SpecDecoder(OrtExecutor(out), spec), prompt, params)
        agreement = check_greedy_near_equal(lambda: TorchExecutor(target, None, 1, SEQ + K + 1),
                                            lambda: OrtExecutor(out), prompt, ref.output, got.output, LOGIT_TOL)
        if agreement.divergence_margin is None:  # same tokens: the same drafting work too
            assert got.stats.drafter_forwards == ref.stats.drafter_forwards


@pytest.mark.parametrize("mode", ["eagle3", "peagle"])
def test_speculative_equals_target_only_within_onnxruntime(exported, mode):
    """The hard gate on one backend: speculative output is the target's own greedy output, exactly
    (deterministic mode: no one-row GEMM, one thread; peagle_trt/executors/onnxruntime.py)."""
    _, _, out, spec = exported("llama", mode)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in PROMPTS:
        spec_run = generate(SpecDecoder(OrtExecutor(out, deterministic=True), spec), prompt, params)
        target_only = generate(SpecDecoder(OrtExecutor(out, deterministic=True), SpecConfig("none", K)), prompt,
                               params)
        assert spec_run.output == target_only.output
        assert spec_run.stats.drafter_forwards > 0


def test_export_refuses_to_overwrite(exported):
    from peagle_trt.errors import BuildError

    target, drafter, out, spec = exported("llama", "peagle")
    with pytest.raises(BuildError, match="already exists"):
        export_models(target, drafter, out, ExportOptions(spec, SLOTS, SEQ))


def test_chunked_prefill_equals_whole_prefill_within_each_backend(exported):
    """Partial prefill chunks run a k=1 drafter pass (its draft discarded) on every backend: chunked
    prefill gives the same tokens as target-only decoding with a whole prefill, on each backend
    (exact, in deterministic mode); across the two backends the usual near-equality holds."""
    target, drafter, out, spec = exported("llama", "peagle")
    prompt = list(range(200, 237))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    outputs = []
    for make in (lambda: TorchExecutor(target, drafter, SLOTS, SEQ + K + 1, deterministic=True),
                 lambda: OrtExecutor(out, deterministic=True)):
        ex = make()
        decoder = SpecDecoder(ex, spec)
        seq = new_sequence(decoder, prompt, params)
        while not seq.prefilled:
            decoder.prefill([seq], chunk=8)
        while not seq.finished:
            decoder.step([seq])
        assert len(seq.output) == 20
        assert seq.output == generate(SpecDecoder(make(), SpecConfig("none", K)), prompt, params).output
        outputs.append(seq.output)
    check_greedy_near_equal(lambda: TorchExecutor(target, None, 1, SEQ + K + 1), lambda: OrtExecutor(out),
                            prompt, outputs[0], outputs[1], LOGIT_TOL)
