"""Qwen3-MoE and GPT-OSS targets equal transformers' own models (Qwen3MoeForCausalLM,
GptOssForCausalLM) on tiny seeded checkpoints: logits and tap hidden states, with and without
KV cache, chunked prefill across the sliding window, the window-sized ring KV cache; MXFP4
experts dequantize exactly; GPT-OSS EOS ids and chat template come from its own files."""

from __future__ import annotations

import pytest
import torch

from peagle_trt.checkpoint import mxfp4
from peagle_trt.checkpoint.target import load_target
from peagle_trt.config import KVLayout
from peagle_trt.models.memory import kv_memory
from peagle_trt.tokenizer import TextCodec
from tests.helpers import chunked_forward, hf_target, our_target, paged_forward

FAMILIES = ["qwen3_moe", "gpt_oss"]
TAPS = (0, 2, 4, 5, 7)



@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_taps_equal_transformers(tiny_moe, family):
    ours, hf = our_target(tiny_moe[family], TAPS), hf_target(tiny_moe[family])
    ids = torch.randint(0, 500, (2, 40))  # longer than GPT-OSS's window of 8
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        logits, aux = ours(ids, torch.arange(40).expand(2, -1), torch.tensor([1, 0]), ours.new_cache(2, 64))
    torch.testing.assert_close(logits, ref.logits, rtol=1e-4, atol=1e-4)
    for i, tap in enumerate(TAPS):  # tap i = hidden state entering layer i
        torch.testing.assert_close(aux[..., i * 64:(i + 1) * 64], ref.hidden_states[tap], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("paged", [False, True])  # True: blocks of 4 from the BlockManager, windows freed
def test_chunked_prefill_with_cache_equals_full_forward(tiny_moe, family, paged):
    ours, hf = our_target(tiny_moe[family], TAPS), hf_target(tiny_moe[family])
    ids = torch.randint(0, 500, (1, 45))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    if paged:
        logits, aux, cache, blocks = paged_forward(ours, ids)
    else:
        logits, aux = chunked_forward(ours, ids, ours.new_cache(1, 64))
    torch.testing.assert_close(logits, ref.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(aux[..., 64:128], ref.hidden_states[2], rtol=1e-4, atol=1e-4)
    if family == "gpt_oss" and paged:  # window 8: the sliding layers gave back every block before 33 - 7
        assert ours.kv_windows == (0, 8) and blocks[1][:6] == [-1] * 6 and min(blocks[1][6:]) >= 0
        assert len(blocks[0]) == 12 and min(blocks[0]) >= 0  # full layers keep all 45 positions


def test_kv_memory_grows_with_full_layers_only(tiny_moe):
    c = load_target(tiny_moe["gpt_oss"]).config
    block = 2 * c.num_kv_heads * 32 * c.head_dim * 2  # K and V of one 32-position block, bf16
    kv = KVLayout.for_sequences(4, 4096, max_rows=8)  # 4 requests of 4096 positions: 512 blocks
    mem = kv_memory(c, None, kv)
    # sliding layers (window 8) hold ceil((8 + 8) / 32) + 1 = 2 blocks per request, + the trash block
    assert mem.target_bytes_per_block == 4 * block and mem.window_bytes == 4 * block * (4 * 2 + 1)
    assert (mem.full_layers, mem.windowed_layers) == (4, 4) and mem.total_bytes == 513 * 4 * block + mem.window_bytes


def test_mxfp4_dequantizes_exactly():
    # one row, one block: codes 0..15 then 15..0; scale 2^(128-127) = 2
    codes = list(range(16)) + list(range(15, -1, -1))
    blocks = torch.tensor([[[[codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(16)]]]], dtype=torch.uint8)
    scales = torch.tensor([[[128]]], dtype=torch.uint8)
    values = mxfp4.dequantize(blocks, scales)  # [1, 32, 1]
    expected = torch.tensor([mxfp4.FP4_VALUES[c] * 2 for c in codes])
    assert torch.equal(values[0, :, 0], expected)
    grid = torch.ldexp(torch.tensor(mxfp4.FP4_VALUES)[torch.randint(0, 16, (3, 64, 5))],
                       torch.randint(-4, 4, (3, 1, 5)))  # exactly representable
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(grid)), grid)


def test_mxfp4_checkpoint_equals_transformers_dequantized(tiny_moe):
    """The MXFP4 layout (`*_blocks` / `*_scales`) read by us equals transformers' own reading."""
    path = tiny_moe["gpt_oss_mxfp4"]
    ours, hf = our_target(path, TAPS), hf_target(path)
    assert load_target(path).config.quantization is None  # dequantized on load
    ids = torch.randint(0, 500, (1, 24))
    with torch.no_grad():
        ref = hf(ids).logits
        logits, _ = ours(ids, torch.arange(24)[None], torch.tensor([0]), ours.new_cache(1, 32))
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_gpt_oss_eos_and_chat_template_from_its_files(tiny_moe):
    codec = TextCodec(tiny_moe["gpt_oss"])
    tok = codec.tok
    assert codec.eos_ids == tuple(sorted(tok.convert_tokens_to_ids(["<|return|>", "<|endoftext|>", "<|call|>"])))
    ids = codec.encode_prompt("hi")
    assert ids[0] == tok.convert_tokens_to_ids("<|start|>")
    assert tok.decode(ids).endswith("<|start|>assistant")


def test_qwen3_moe_sparse_layer_rule_matches_transformers(tmp_path):
    from peagle_trt.make_tiny import make_target

    path = make_target(tmp_path / "q", "qwen3_moe", layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    c = load_target(path).config
    hf = hf_target(path)
    assert c.moe_layers == tuple(hasattr(layer.mlp, "experts") for layer in hf.model.layers)
    assert c.moe_layers == (False, True, False, False, False, True)


@pytest.mark.parametrize("cfg,taps", [
    ({"model_type": "qwen3_moe", "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
      "moe_intermediate_size": 768, "intermediate_size": 5472}, (2, 24, 45)),  # Qwen3-Coder-30B-A3B
    ({"model_type": "gpt_oss", "num_hidden_layers": 24, "num_local_experts": 32, "num_experts_per_tok": 4,
      "intermediate_size": 2880, "sliding_window": 128}, (2, 12, 21)),  # gpt-oss-20b
    ({"model_type": "gpt_oss", "num_hidden_layers": 36, "num_local_experts": 128, "num_experts_per_tok": 4,
      "intermediate_size": 2880, "sliding_window": 128}, (2, 18, 33)),  # gpt-oss-120b
])
def test_published_heads_tap_the_layers_vllm_taps(cfg, taps):
    """vLLM's default EAGLE-3 taps (2, L//2, L-3) for the targets of the published P-EAGLE heads
    (no eagle_aux_hidden_state_layer_ids in those heads)."""
    from peagle_trt.checkpoint.adapters import adapter_for

    full = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, **cfg}
    assert adapter_for(full, "cfg").parse(full, "cfg").default_taps == taps
