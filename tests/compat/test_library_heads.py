"""Heads written by the `speculators` library (0.9.0) load, compute what the library computes,
and generate token-identically to the target.

Oracle: the library's own PyTorch forwards, run by tests/compat/speculators_driver.py in its own
venv (see conftest.py): the EAGLE-3 TTT forward (sequential steps, so norm_output's feedback is
exercised) and the P-EAGLE parallel forward (COD-sampled mask chains). We rebuild each logit row
with our drafter over our KV cache and compare in fp32 within 1e-4.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from peagle_trt.checkpoint import load_pair
from peagle_trt.checkpoint.drafter import load_drafter
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.models.drafter import DrafterModel
from peagle_trt.runtime.scheduler import generate
from peagle_trt.speculative.decoder import SpecDecoder
from tests.compat.cases import DEPTH, WINDOW, WRITTEN

ATOL = 1e-4
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)
PROMPTS = ([7], list(range(30, 47)))
# the onnxruntime runs (an export each) cover the trainer defaults and every flag value once
ORT_CASES = ["peagle-defaults-llama", "peagle-defaults-qwen3", "eagle3-defaults-llama",
             "eagle3-defaults-qwen3",
             "peagle-norm_before_fc-out1-nbr0-qwen3-on-llama", "peagle-fc_norm-out0-nbr1-llama-on-qwen3",
             "eagle3-fc_norm-out1-nbr1-qwen3-on-qwen3", "eagle3-2taps-final-2layers",
             "peagle-window8-2layers", "eagle3-window8-qwen3"]


def drafter_of(library, name: str) -> DrafterModel:
    ck = load_drafter(library["heads"] / name)
    return DrafterModel.from_tensors(ck.config, ck.tensors)


def ttt_logits(model: DrafterModel, o: dict, steps: int) -> torch.Tensor:
    """The library's TTT forward rebuilt row by row: chain i = rows 0..i, then step s feeds
    (token i+s, the fed-back hidden of step s-1) at position i+s."""
    ids, pos = o["input_ids"][0], o["position_ids"][0]  # [L]
    g = model.project(o["hidden_states"][0])  # [L, H]
    n, slots = ids.shape[0], torch.zeros(1, dtype=torch.long)
    out = torch.empty(steps, n, model.config.draft_vocab_size)
    for i in range(n):
        cache = model.new_cache(1, 64)
        logits, fed = model(ids[None, :i + 1], g[None, :i + 1], pos[None, :i + 1], slots, cache)
        out[0, i], h = logits[0, i], fed[0, i]
        for s in range(1, steps):
            tok = int(ids[i + s]) if i + s < n else 0  # the library pads the shifted ids with 0
            logits, fed = model(torch.tensor([[tok]]), h[None, None], pos[i:i + 1][None] + s, slots, cache)
            out[s, i], h = logits[0, 0], fed[0, 0]
    return out


def ttt_window_rows(c, steps: int, n: int) -> torch.Tensor:
    """[T, L] rows of the TTT oracle that define sliding-window semantics. Step 0 rows (row i at
    position i) and the P-EAGLE parallel forward use keys > p - W, the query's own position p
    (peagle/attention.py: kv_anchor > q_anchor + q_depth - W), as transformers and we do. The
    library's TTT training mask for steps s >= 1 instead keeps the context window of the chain's
    last real row i (keys > i - W, eagle3/attention.py + extend_*_mask_for_draft_tokens) for a
    query at position i + s: a training-time shortcut no sequential drafter can reproduce from
    positions alone, so those rows are compared only while i + s < W (both windows hold every
    earlier key); every step-0 row is compared, windowed ones included."""
    keep = torch.ones(steps, n, dtype=torch.bool)
    if c.sliding_layers:
        s, i = torch.arange(steps)[:, None], torch.arange(n)[None]
        keep &= (s == 0) | (i + s < c.sliding_window)
    return keep


def parallel_logits(model: DrafterModel, o: dict) -> torch.Tensor:
    """The library's P-EAGLE forward rebuilt per anchor: rows 0..a (real), then mask rows."""
    ids, anchors, depths = o["input_ids"][0], o["anchor_pos"], o["depth"]
    g = model.project(o["hidden_states"][0])  # [L, H]
    mask_id, slots = model.config.mask_token_id, torch.zeros(1, dtype=torch.long)
    out = torch.empty(anchors.shape[0], model.config.draft_vocab_size)
    for a in anchors.unique().tolist():
        chain = (anchors == a).nonzero().flatten()
        extra = int(depths[chain].max())
        tokens = torch.cat([ids[:a + 1], torch.full((extra,), mask_id)])[None]  # [1, a+1+D]
        hidden = torch.cat([g[:a + 1], model.h_mask.expand(extra, -1)])[None]
        positions = torch.arange(a + 1 + extra)[None]
        x = model.forward_rows(model.embed_tokens(tokens), hidden, positions, slots, model.new_cache(1, 64))
        out[chain] = model.logits(x)[0, a + depths[chain]]
    return out


def test_library_defaults_are_what_the_issue_says(library):
    """The trainer's defaults (what a user gets): P-EAGLE norm_output=false, EAGLE-3
    norm_before_fc and norm_output true; and the library refuses both fc norms."""
    r = library["results"]
    assert r["peagle-defaults-llama"]["flags"]["norm_output"] is False
    assert r["eagle3-defaults-llama"]["flags"]["norm_before_fc"] is True
    assert r["eagle3-defaults-llama"]["flags"]["norm_output"] is True
    assert "mutually exclusive" in r["refused-both-fc-norms"]["refused"]
    assert sorted(n for n in r if "refused" not in r[n]) == sorted(WRITTEN)


@pytest.mark.parametrize("name", WRITTEN)
def test_drafter_logits_equal_the_library_forward(library, name):
    model = drafter_of(library, name)
    o = load_file(str(library["oracle"] / f"{name}.safetensors"))
    cfg = json.loads((library["heads"] / name / "config.json").read_text())
    c = model.config
    assert (c.norm_before_fc, c.fc_norm, c.norm_output, c.norm_before_residual) == (
        cfg["norm_before_fc"], cfg["fc_norm"], cfg["norm_output"], cfg["norm_before_residual"])
    with torch.no_grad():
        ours, theirs = ttt_logits(model, o, o["ttt_logits"].shape[0]), o["ttt_logits"]
        keep = ttt_window_rows(c, theirs.shape[0], theirs.shape[1])
        if "window" in name:  # the small-window heads: the oracle inputs run past W
            assert theirs.shape[1] > c.sliding_window and c.sliding_window == WINDOW
        torch.testing.assert_close(ours[keep], theirs[keep], atol=ATOL, rtol=0)
        if "peagle_logits" in o:
            torch.testing.assert_close(parallel_logits(model, o), o["peagle_logits"], atol=ATOL, rtol=0)


def _modes(case: dict) -> list[str]:
    return ["none", "eagle3"] + (["peagle"] if case["type"] == "peagle" else [])


def _check_identical(decoders: dict) -> None:
    for prompt in PROMPTS:
        reference = generate(decoders["none"], prompt, PARAMS).output
        for mode, decoder in decoders.items():
            assert generate(decoder, prompt, PARAMS).output == reference, (mode, prompt)


@pytest.mark.parametrize("name", WRITTEN)
def test_greedy_generation_equals_target_torch(library, name):
    case = library["cases"][name]
    spec = SpecConfig(case["type"], DEPTH)  # the pair is validated for the head's own mode
    pair = load_pair(library["targets"][case["family"]], library["heads"] / name, spec)
    cfg = json.loads((library["heads"] / name / "config.json").read_text())
    # the target feeds the layers the library trained on
    assert list(pair.taps) == cfg["eagle_aux_hidden_state_layer_ids"]
    target, drafter = pair.build()
    _check_identical({m: SpecDecoder(TorchExecutor(target, drafter if m != "none" else None, 1, 128,
                                                   deterministic=True),
                                     SpecConfig(m, DEPTH)) for m in _modes(case)})


@pytest.mark.parametrize("name", ORT_CASES)
def test_greedy_generation_equals_target_onnxruntime(library, name, tmp_path):
    from peagle_trt.executors.onnxruntime import OrtExecutor
    from peagle_trt.export import ExportOptions, export_models

    case = library["cases"][name]
    spec = SpecConfig(case["type"], DEPTH)
    target, drafter = load_pair(library["targets"][case["family"]], library["heads"] / name, spec).build()
    export = ExportOptions(spec, 1, 100)
    export_models(target, drafter, tmp_path / "export", export)
    if drafter.config.sliding_layers:  # the graphs carry each window that cuts (W < 104 KV positions)
        import onnx

        graph = onnx.load(str(tmp_path / "export" / "drafter_step.onnx"), load_external_data=False).graph
        windows = [next((a.i for a in n.attribute if a.name == "sliding_window"), 0)
                   for n in graph.node if n.op_type == "PEagleKVAttention"]
        expected = [drafter.config.window(i) for i in range(drafter.config.num_layers)]
        assert windows == [w if w < export.max_len else 0 for w in expected]
        assert any(windows) == name.endswith(("window8-2layers", "window8-qwen3"))
    executor = OrtExecutor(tmp_path / "export", deterministic=True)
    _check_identical({m: SpecDecoder(executor, SpecConfig(m, DEPTH)) for m in _modes(case)})


def test_both_fc_norms_refused_with_the_library_reason(library, tmp_path):
    head = shutil.copytree(library["heads"] / "eagle3-defaults-llama", tmp_path / "head")
    cfg = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**cfg, "norm_before_fc": True, "fc_norm": True}))
    with pytest.raises(ConfigError, match="norm_before_fc and fc_norm are mutually exclusive"):
        load_drafter(head)


def test_default_window_head_accepted_at_max_seq_len_2048(library):
    """The trainer's default drafter layers use sliding-window attention (window 2048). The
    default `build --max-seq-len 2048` with K=7 needs 2056 KV positions: torch (and onnxruntime)
    compute the window, so they serve it; the TensorRT plugins cannot and refuse, saying why."""
    from peagle_trt.checkpoint.drafter import check_window

    case = library["cases"]["peagle-defaults-qwen3"]
    spec = SpecConfig("peagle", 7)
    pair = load_pair(library["targets"]["qwen3"], library["heads"] / case["name"], spec)
    c = pair.drafter.config
    assert c.sliding_layers == (0,) and c.sliding_window == 2048
    max_len = 2048 + spec.num_spec_tokens + 1
    target, drafter = pair.build()
    executor = TorchExecutor(target, drafter, 1, max_len)  # refused before windows were computed
    assert executor.drafter_cache.max_len == max_len and executor.drafter_cache.groups == (0,)
    for backend in ("torch", "onnxruntime"):
        check_window(c, max_len, backend)
    with pytest.raises(ConfigError, match=r"window 2048\).*tensorrt backend.*does not implement windows"):
        check_window(c, max_len, "tensorrt")


def test_inspect_describes_a_library_head(library, capsys):
    from peagle_trt.cli import main

    head, target = library["heads"] / "peagle-defaults-qwen3", library["targets"]["qwen3"]
    assert main(["inspect", str(target), str(head), "--backend", "tensorrt"]) == 2  # 2048 + 8 > W
    assert "sliding-window attention (window 2048)" in capsys.readouterr().out
    assert main(["inspect", str(target), str(head)]) == 0  # torch computes the window
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    d = result["drafter"]
    assert d["layout"] == "speculators" and d["layer_family"] == "qwen3" and d["trained_k"] == DEPTH
    assert d["flags"]["norm_output"] is False and d["flags"]["norm_before_residual"] is True
    assert d["sliding_window"]["window"] == 2048 and d["sliding_window"]["layers"] == [0]
    assert result["pair"]["fits"] and result["pair"]["taps"] == [2, 4, 5]
