"""The reference target equals transformers' own model on the same weights (logits with and
without KV cache, tap hidden states), and RoPE variants match transformers' formulas."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from peagle_trt.checkpoint import load_pair, load_target
from peagle_trt.config import SpecConfig
from peagle_trt.make_tiny import make_target
from peagle_trt.models.target import TargetModel


def _ours(path, taps=(2, 4, 5)):
    ckpt = load_target(path)
    return TargetModel.from_tensors(ckpt.config, ckpt.tensors, taps)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_target_logits_and_taps_equal_transformers(tiny, family):
    ours = _ours(tiny[family], taps=(0, 2, 4, 5, 8))
    hf = AutoModelForCausalLM.from_pretrained(tiny[family]).eval()
    ids = torch.randint(0, 500, (2, 23))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        cache = ours.new_cache(4, 64)
        logits, aux = ours(ids, torch.arange(23).expand(2, -1), torch.tensor([3, 1]), cache)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)
    for i, tap in enumerate((0, 2, 4, 5)):  # tap i = hidden state entering layer i
        torch.testing.assert_close(aux[..., i * 64:(i + 1) * 64], ref.hidden_states[tap])
    assert not torch.allclose(aux[..., 64:128], aux[..., 128:192])  # distinct layers


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_target_incremental_with_kv_cache_equals_full_forward(tiny, family):
    ours = _ours(tiny[family])
    hf = AutoModelForCausalLM.from_pretrained(tiny[family]).eval()
    ids = torch.randint(0, 500, (1, 30))
    with torch.no_grad():
        ref = hf(ids).logits
        cache = ours.new_cache(1, 64)
        chunks, outs = [(0, 11), (11, 12), (12, 20), (20, 30)], []  # prefill, decode, verify-like
        for a, b in chunks:
            logits, _ = ours(ids[:, a:b], torch.arange(a, b)[None], torch.tensor([0]), cache)
            outs.append(logits)
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=1e-4, atol=1e-5)


def test_stale_cache_entries_past_the_row_are_ignored(tiny):
    """Rejected drafts leave K/V past the committed length: later rows must not see them."""
    ours = _ours(tiny["llama"])
    ids = torch.randint(0, 500, (1, 16))
    with torch.no_grad():
        clean = ours.new_cache(1, 64)
        ref, _ = ours(ids, torch.arange(16)[None], torch.tensor([0]), clean)
        dirty = ours.new_cache(1, 64)
        ours(torch.randint(0, 500, (1, 20)), torch.arange(20)[None], torch.tensor([0]), dirty)
        ours(ids[:, :10], torch.arange(10)[None], torch.tensor([0]), dirty)  # positions 10..19 stale
        out, _ = ours(ids[:, 10:], torch.arange(10, 16)[None], torch.tensor([0]), dirty)
    torch.testing.assert_close(out, ref[:, 10:], rtol=1e-4, atol=1e-5)


def test_padded_rows_do_not_disturb_real_rows(tiny):
    ours = _ours(tiny["llama"])
    a, b = torch.randint(0, 500, (1, 9)), torch.randint(0, 500, (1, 5))
    with torch.no_grad():
        ref_a, _ = ours(a, torch.arange(9)[None], torch.tensor([0]), ours.new_cache(1, 32))
        ref_b, _ = ours(b, torch.arange(5)[None], torch.tensor([0]), ours.new_cache(1, 32))
        tokens = torch.cat([a, torch.cat([b, torch.zeros(1, 4, dtype=torch.long)], 1)])
        positions = torch.stack([torch.arange(9), torch.tensor([0, 1, 2, 3, 4, -1, -1, -1, -1])])
        out, _ = ours(tokens, positions, torch.tensor([1, 0]), ours.new_cache(2, 32))
    torch.testing.assert_close(out[0], ref_a[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[1, :5], ref_b[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
     "beta_fast": 16, "beta_slow": 2},
])
def test_rope_variants_match_transformers(tmp_path, rope):
    path = make_target(tmp_path / "t", "llama", layers=2, rope=rope)
    ours = _ours(path, taps=())
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, 500, (1, 340))  # far positions exercise the scaling
    with torch.no_grad():
        ref = hf(ids).logits
        logits, _ = ours(ids, torch.arange(340)[None], torch.tensor([0]), ours.new_cache(1, 400))
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-5)


def test_legacy_rope_scaling_keys_are_read(tiny, tmp_path):
    """Older configs spell rope as rope_theta + rope_scaling{type: ...}."""
    import json
    import shutil

    path = tmp_path / "legacy"
    shutil.copytree(tiny["llama"], path)
    cfg = json.loads((path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_target(path).config.rope == load_target(tiny["llama"]).config.rope


@pytest.mark.parametrize("target,drafter", [("llama", "aws"), ("qwen3", "speculators"), ("llama", "eagle3")])
def test_drafter_layouts_load(tiny, target, drafter):
    mode = "eagle3" if drafter == "eagle3" else "peagle"
    pair = load_pair(tiny[target], tiny[drafter], SpecConfig(mode, 3))
    _, model = pair.build()
    c = model.config
    assert c.layout == drafter and c.num_layers == 2 and c.draft_vocab_size == 384
    assert model.h_mask.shape == (64,)
    if drafter != "eagle3":
        assert c.mask_token_id is not None and c.has_mask_hidden
        expected = model.project(model.mask_hidden).reshape(-1)
        torch.testing.assert_close(model.h_mask, expected)  # h_mask = fc(mask_hidden), pre-fc storage
    assert (model.to_target_ids(torch.arange(384)) < 512).all()
    assert c.norm_before_fc == (drafter == "speculators")
