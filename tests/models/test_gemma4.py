"""Gemma-4 targets equal transformers' own models (Gemma4ForCausalLM, and the multimodal wrapper
Gemma4ForConditionalGeneration on text) on tiny seeded checkpoints: logits and tap hidden states,
with and without KV cache, chunked prefill across the sliding window, KV-shared layers reading
their owner's (windowed) cache; per-layer head sizes, k_eq_v, proportional rope, per-layer inputs,
soft-capping (the tiny config sets them all, peagle_trt/make_tiny/checkpoints.py GEMMA4), and the MoE block.
Settings we do not implement are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from peagle_trt.checkpoint.target import load_target
from peagle_trt.config import KVLayout
from peagle_trt.errors import ConfigError
from peagle_trt.models.memory import kv_memory
from tests.helpers import chunked_forward, hf_target, our_target, paged_forward

TAPS = (0, 2, 4, 5, 7)  # 5 and 7: entering / leaving KV-shared layers



def _check(logits, aux, ref, rows=slice(None)):
    torch.testing.assert_close(logits, ref.logits[:, rows], rtol=1e-4, atol=1e-4)
    for i, tap in enumerate(TAPS):  # tap i = hidden state entering layer i (0: the scaled embedding)
        torch.testing.assert_close(aux[..., i * 64:(i + 1) * 64], ref.hidden_states[tap][:, rows],
                                   rtol=1e-4, atol=1e-4)


def test_logits_and_taps_equal_transformers(tiny_moe):
    ours, hf = our_target(tiny_moe["gemma4"], TAPS), hf_target(tiny_moe["gemma4"])
    ids = torch.randint(0, 500, (2, 40))  # longer than the window of 8
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        logits, aux = ours(ids, torch.arange(40).expand(2, -1), torch.tensor([1, 0]), ours.new_cache(2, 64))
    _check(logits, aux, ref)


@pytest.mark.parametrize("paged", [False, True])  # True: blocks of 4 from the BlockManager, windows freed
def test_chunked_prefill_with_cache_equals_full_forward(tiny_moe, paged):
    ours, hf = our_target(tiny_moe["gemma4"], TAPS), hf_target(tiny_moe["gemma4"])
    ids = torch.randint(0, 500, (1, 45))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    if paged:
        logits, aux, cache, blocks = paged_forward(ours, ids)
        assert blocks[1][:6] == [-1] * 6  # the sliding layers (and their sharers) gave back what slid out
    else:
        logits, aux = chunked_forward(ours, ids, cache := ours.new_cache(1, 64))
    _check(logits, aux, ref)
    # KV-shared layers 5, 6, 7 hold no cache: they read layers 2, 4, 2 (and sit in their groups)
    assert cache.k[5] is cache.k[2] and cache.k[6] is cache.k[4] and cache.v[7] is cache.v[2]
    assert cache.groups == (1, 1, 0, 1, 1, 0, 1, 0)
    sliding, full = (cache.block_size, 2, 32), (cache.block_size, 1, 64)  # full layers: 1 KV head of 64
    assert [tuple(t.shape[1:]) for t in cache.k] == [sliding, sliding, full, sliding, sliding, full, sliding, full]


def test_decode_steps_equal_transformers_with_its_cache(tiny_moe):
    """One token at a time after a prompt (past the window, through the shared layers' reads of
    another layer's cache), against transformers' own incremental decoding with its KV cache."""
    ours, hf = our_target(tiny_moe["gemma4"], TAPS), hf_target(tiny_moe["gemma4"])
    ids = torch.randint(0, 500, (1, 20))
    with torch.no_grad():
        ref = hf(ids[:, :4], use_cache=True, output_hidden_states=True)
        cache = ours.new_cache(1, 32)
        logits, aux = ours(ids[:, :4], torch.arange(4)[None], torch.tensor([0]), cache)
        _check(logits, aux, ref)
        for p in range(4, 20):
            ref = hf(ids[:, p:p + 1], past_key_values=ref.past_key_values, use_cache=True,
                     output_hidden_states=True)
            logits, aux = ours(ids[:, p:p + 1], torch.tensor([[p]]), torch.tensor([0]), cache)
            _check(logits, aux, ref)


def test_multimodal_wrapper_checkpoint_loads_its_language_model(tiny_moe):
    from transformers import Gemma4ForConditionalGeneration

    path = tiny_moe["gemma4_wrapper"]
    assert json.loads((path / "config.json").read_text())["model_type"] == "gemma4"
    ours = our_target(path, TAPS)
    hf = Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 500, (1, 30))
    with torch.no_grad():
        ref = hf(input_ids=ids, output_hidden_states=True)
        logits, aux = ours(ids, torch.arange(30)[None], torch.tensor([0]), ours.new_cache(1, 32))
    torch.testing.assert_close(logits, ref.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(aux[..., 64:128], ref.hidden_states[2], rtol=1e-4, atol=1e-4)


def test_kv_memory_skips_shared_layers_and_keeps_windows(tiny_moe):
    c = load_target(tiny_moe["gemma4"]).config
    block = lambda kv, d: 2 * kv * 32 * d * 2  # noqa: E731 (K and V of a 32-position block, bf16)
    mem = kv_memory(c, None, KVLayout.for_sequences(1, 4096, max_rows=8))
    # owners: sliding 0, 1, 3, 4 (2 KV heads x 32, window 8: 2 blocks + trash); full 2 (1 KV head x 64)
    assert mem.target_bytes_per_block == block(1, 64) and mem.window_bytes == 4 * 3 * block(2, 32)
    assert (mem.full_layers, mem.windowed_layers, mem.shared_layers) == (1, 4, 3)
    assert "3 KV-shared" in mem.describe()


@pytest.mark.parametrize("key,value,feature", [
    ("top_k_experts", None, "top_k_experts"),  # with enable_moe_block the expert fields are required
    ("use_bidirectional_attention", "all", "use_bidirectional_attention"),
    ("hidden_activation", "silu", "hidden_activation"),
    ("num_kv_shared_layers", 7, "num_kv_shared_layers"),
])
def test_unsupported_features_are_refused_by_name(tiny_moe, tmp_path, key, value, feature):
    family = "gemma4_moe" if key == "top_k_experts" else "gemma4"
    cfg = json.loads((tiny_moe[family] / "config.json").read_text())
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from peagle_trt.checkpoint.target import load_target_config

    with pytest.raises(ConfigError, match=feature):
        load_target_config(tmp_path)


def test_released_config_spelling_global_head_dim(tiny_moe):
    """Released configs say global_head_dim / num_global_key_value_heads (no per_layer_config)."""
    from peagle_trt.checkpoint.adapters import adapter_for

    cfg = json.loads((tiny_moe["gemma4"] / "config.json").read_text())
    ours = load_target(tiny_moe["gemma4"]).config
    old = {k: v for k, v in cfg.items() if k != "per_layer_config"}
    old.update(global_head_dim=64, num_global_key_value_heads=1)
    assert adapter_for(old, "cfg").parse(old, "cfg") == ours
    wrapped = {"model_type": "gemma4", "text_config": cfg}
    assert adapter_for(wrapped, "cfg").parse(wrapped, "cfg") == ours


def test_gemma4_31b_head_taps_the_layers_vllm_taps():
    """vLLM's Gemma4 takes its EAGLE-3 aux states from the default layers (2, L//2, L-3), tap i
    being the stream entering layer i (0: the scaled embedding); here a 60-layer config."""
    from peagle_trt.checkpoint.adapters import adapter_for

    cfg = {"model_type": "gemma4", "text_config": {
        "model_type": "gemma4_text", "num_hidden_layers": 60, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "vocab_size": 512,
        "intermediate_size": 128, "sliding_window": 1024, "hidden_size_per_layer_input": 0}}
    assert adapter_for(cfg, "cfg").parse(cfg, "cfg").default_taps == (2, 30, 57)


def test_inspect_prints_kv_memory_without_shared_layers(tiny_moe, capsys):
    from peagle_trt.cli import main

    pair = [str(tiny_moe["gemma4"]), str(tiny_moe["drafter-gemma4"])]
    assert main(["inspect", *pair, "--max-seq-len", "512"]) == 0
    out = capsys.readouterr().out
    mem = json.loads(out.strip().splitlines()[-1])["kv_memory"]
    c = load_target(tiny_moe["gemma4"]).config
    without = kv_memory(c, None, KVLayout.for_sequences(1, 512, max_rows=256)).as_dict()
    assert {k: v for k, v in mem.items() if "drafter" not in k and "bytes" not in k} == \
        {k: v for k, v in without.items() if "drafter" not in k and "bytes" not in k}
    assert mem["target_bytes_per_block"] == without["target_bytes_per_block"] and mem["drafter_bytes_per_block"] > 0
    assert mem["shared_layers"] == 3 and "3 KV-shared" in out


def test_moe_block_equals_transformers(tiny_moe):
    """enable_moe_block (the 26B-A4B layout): router norm / scales, GeGLU experts beside the dense MLP."""
    path = tiny_moe["gemma4_moe"]
    c = load_target(path).config
    assert c.moe.beside_dense and c.moe_layers == (True,) * 8
    ours, hf = our_target(path, TAPS), hf_target(path)
    ids = torch.randint(0, 500, (1, 45))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    logits, aux = chunked_forward(ours, ids, ours.new_cache(1, 64),
                                  ((0, 11), (11, 12), (12, 24), (24, 45 - 12), (45 - 12, 45)))
    _check(logits, aux, ref)
