"""Small seeded checkpoints in the real on-disk layouts, for tests and the CPU demo.

Targets are real transformers models (Llama, Qwen3, Qwen3-MoE, GPT-OSS, Gemma-4) built from their
config classes and saved with `save_pretrained`, plus a byte-level BPE tokenizer with a ChatML
chat template (GPT-OSS: a harmony-style template and several EOS ids, as released; optionally its
experts in the MXFP4 layout of the released checkpoints). Drafters are written in the AWS P-EAGLE
layout (`midlayer.*`, `mask_hidden`,
`ptd_token_id`, `d2t`/`t2d` with a smaller draft vocabulary), the `speculators` layout, and as a
plain EAGLE-3 head. Weights are random: acceptance of these drafters is low by construction.

    peagle-trt make-tiny OUT_DIR [--families]
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 512
MASK_TOKEN = "<|reserved_mask|>"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", MASK_TOKEN]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "Speculative decoding lets a small drafter propose tokens that a large target verifies.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Write a short poem about the sea, the wind, and the long road home.",
    "TensorRT builds optimized engines; Triton serves them over HTTP and gRPC.",
    "Explain how a transformer attends to earlier tokens with keys, values and queries.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 plus minus times equals",
]


HARMONY = ["<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]
HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>"
                    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def make_tokenizer(out: Path, extra: list[str] = (), template: str = CHAT_TEMPLATE) -> dict[str, int]:
    """Train a tiny byte-level BPE tokenizer and save it (with a chat template) into `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = SPECIAL + list(extra)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 64, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=special[1:])
    fast.chat_template = template
    fast.save_pretrained(out)
    return {t: tok.token_to_id(t) for t in special}


FAMILIES = ("llama", "qwen3", "qwen3_moe", "gpt_oss", "gemma4", "gemma4_wrapper", "gemma4_moe")
# Gemma-4 (text): sliding (window 8) / full layers with their own head size (global_head_dim 64)
# and KV heads (k_eq_v), the last 3 layers KV-shared (layer 5 reads layer 2's cache, 6 reads 4's,
# 7 reads 2's), double-wide MLPs there, per-layer inputs, soft-capped logits, default ropes
# (full layers: proportional, 25% of the pairs rotate)
GEMMA4_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
GEMMA4 = dict(global_head_dim=64, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
              num_kv_shared_layers=3, use_double_wide_mlp=True, hidden_size_per_layer_input=16,
              vocab_size_per_layer_input=VOCAB, final_logit_softcapping=30.0, intermediate_size=64,
              tie_word_embeddings=True, layer_types=GEMMA4_TYPES)
# gemma4_moe: the same with the MoE block (8 experts, top 2) beside every dense MLP
GEMMA4_MOE = dict(GEMMA4, enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32)


def make_target(out: Path, family: str = "llama", seed: int = 0, layers: int = 8,
                rope: dict | None = None, shard: bool = False, mxfp4: bool = False, **overrides) -> Path:
    """A random `family` target (one of FAMILIES) with tokenizer, saved to `out`. `overrides`
    replace config fields (e.g. sliding_window); `mxfp4` (gpt_oss) stores the experts as MXFP4
    blocks + scales, their values snapped to that grid before saving."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    gpt_oss = family == "gpt_oss"
    ids = make_tokenizer(out, HARMONY, HARMONY_TEMPLATE) if gpt_oss else make_tokenizer(out)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, initializer_range=0.1, eos_token_id=ids["<|endoftext|>"],
                  bos_token_id=None, pad_token_id=ids["<|endoftext|>"])
    if family == "llama":
        rope = rope or {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 256}
        fields, cls = dict(rope_parameters=rope, tie_word_embeddings=False), "Llama"
    elif family == "qwen3":
        rope = rope or {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 8.0,
                        "original_max_position_embeddings": 512}
        fields, cls = dict(rope_parameters=rope, tie_word_embeddings=True), "Qwen3"
    elif family == "qwen3_moe":  # dense layers 0 and 5 (mlp_only_layers), sparse elsewhere
        rope = rope or {"rope_type": "default", "rope_theta": 1000000.0}
        fields, cls = dict(rope_parameters=rope, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                           mlp_only_layers=[0, 5]), "Qwen3Moe"
    elif family == "gpt_oss":  # alternating sliding (window 8) / full layers, sinks, clamped SwiGLU
        rope = rope or {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "original_max_position_embeddings": 64, "truncate": False}
        fields, cls = dict(rope_parameters=rope, tie_word_embeddings=False, intermediate_size=32,
                           num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                           swiglu_limit=1.5, attention_bias=True, rms_norm_eps=1e-5,
                           max_position_embeddings=2048, eos_token_id=ids["<|return|>"]), "GptOss"
    elif family in ("gemma4", "gemma4_wrapper", "gemma4_moe"):  # GEMMA4; the wrapper adds a vision tower
        fields = dict(GEMMA4_MOE if family == "gemma4_moe" else GEMMA4)
        fields, cls = dict(fields, rope_parameters=rope) if rope else fields, "Gemma4Text"
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    config = getattr(transformers, f"{cls}Config")(**{**common, **fields, **overrides})
    torch.manual_seed(seed)
    if family == "gemma4_wrapper":
        config = transformers.Gemma4Config(text_config=config.to_dict(), vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, head_dim=16))
        model = transformers.Gemma4ForConditionalGeneration(config).eval()
    else:
        model = getattr(transformers, f"{cls.removesuffix('Text')}ForCausalLM")(config).eval()
    with torch.no_grad():  # non-trivial norms, biases and sinks so a misplaced one shows up
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(("bias", "sinks")):
                p.add_(0.3 * torch.randn_like(p))
            elif "experts" in name:
                p.normal_(0, 0.1)
            elif name.endswith(("router.scale", "per_expert_scale")):  # Gemma-4 router scales
                p.uniform_(0.5, 1.5)
        for name, p in model.named_parameters():  # Gemma-4 attends at scale 1: q/k norm weights of
            if "vision_tower" not in name and name.endswith(("q_norm.weight", "k_norm.weight")) and \
                    family.startswith("gemma4"):  # d^-1/4 each give the usual 1/sqrt(d) temperature
                p.mul_(p.shape[0] ** -0.25)
        for name, b in model.named_buffers():  # Gemma-4's per-layer output scalars
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
        if mxfp4:  # snap the expert weights to the MXFP4 grid (the reference keeps those values)
            from peagle_trt.checkpoint import mxfp4 as fp4
            for name, p in model.named_parameters():
                if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    p.copy_(fp4.dequantize(*fp4.quantize(p)))
    model.save_pretrained(out, max_shard_size="200KB" if shard else "10GB")
    if gpt_oss:  # released checkpoints end a turn on <|return|>, <|endoftext|> or <|call|>
        (out / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": [ids["<|return|>"], ids["<|endoftext|>"], ids["<|call|>"]]}))
    if mxfp4:
        _to_mxfp4(out)
    return out


def _to_mxfp4(out: Path) -> None:
    """Rewrite a saved GPT-OSS checkpoint with MXFP4 experts (`*_blocks` + `*_scales`)."""
    from safetensors.torch import load_file, save_file

    from peagle_trt.checkpoint import mxfp4

    path = out / "model.safetensors"
    tensors = load_file(str(path))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4.quantize(tensors.pop(name))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, str(path), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def drafter_tensors(target_dir: Path, layers: int, draft_vocab: int, seed: int,
                    speculators: bool, mask_hidden: bool) -> tuple[dict, dict]:
    """Random drafter weights (canonical names) and the config fields they imply."""
    from peagle_trt.architecture import DrafterConfig, RopeConfig
    from peagle_trt.models.drafter import DrafterModel

    target_cfg = json.loads((target_dir / "config.json").read_text())
    hidden = target_cfg["hidden_size"]
    config = DrafterConfig(layout="aws", hidden_size=hidden, num_layers=layers, num_heads=4,
                           num_kv_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-6,
                           rope=RopeConfig(10000.0), vocab_size=target_cfg["vocab_size"],
                           draft_vocab_size=draft_vocab, target_hidden_size=hidden,
                           norm_before_fc=speculators)
    torch.manual_seed(seed)
    model = DrafterModel(config)
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()
               if k not in ("d2t", "mask_hidden")}
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            t.mul_(1 + 0.2 * torch.randn_like(t))
    kept = torch.sort(torch.randperm(config.vocab_size)[:draft_vocab]).values  # draft vocab subset
    tensors["d2t"] = kept - torch.arange(draft_vocab)  # offsets: target_id = draft_id + d2t
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    tensors["t2d"] = t2d
    if mask_hidden:
        tensors["mask_hidden"] = torch.randn(1, 1, 3 * hidden)
    return tensors, {"hidden_size": hidden, "vocab_size": config.vocab_size}


def make_drafter(out: Path, target_dir: Path, layout: str = "aws", seed: int = 1, layers: int = 2,
                 draft_vocab: int = 384, mask_id: int | None = None) -> Path:
    """A random drafter for the target in `target_dir`; layout: aws | speculators | eagle3.

    mask_id: the mask token's id; None: the id of MASK_TOKEN in the target's tokenizer.json (the
    tiny targets add it; for a pretrained target pass an existing id: an untrained head accepts
    nothing anyway)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors, _ = drafter_tensors(target_dir, layers, draft_vocab, seed, layout == "speculators",
                                 layout != "eagle3")
    if mask_id is None:
        added = json.loads((target_dir / "tokenizer.json").read_text())["added_tokens"]
        mask_id = next(t["id"] for t in added if t["content"] == MASK_TOKEN)
    target_cfg = json.loads((target_dir / "config.json").read_text())
    layer_cfg = {"model_type": "llama", "hidden_size": target_cfg["hidden_size"],
                 "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 16, "intermediate_size": 128, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                 "rope_theta": 10000.0, "max_position_embeddings": 4096,
                 "vocab_size": target_cfg["vocab_size"]}
    if layout == "speculators":
        config = {"speculators_model_type": "peagle", "architectures": ["PeagleSpeculator"],
                  "transformer_layer_config": layer_cfg, "draft_vocab_size": draft_vocab,
                  "norm_before_residual": False, "norm_before_fc": True, "fc_norm": False,
                  "mask_token_id": mask_id, "embed_requires_grad": True,
                  "speculators_config": {"algorithm": "peagle", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy",
                                                               "speculative_tokens": 8}]}}
    else:
        tensors = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                   for k, v in tensors.items()}
        config = {**layer_cfg, "architectures": ["LlamaForCausalLMEagle3"],
                  "draft_vocab_size": draft_vocab, "target_hidden_size": target_cfg["hidden_size"]}
        if layout == "aws":
            config["ptd_token_id"] = mask_id
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def make_all(out: Path) -> dict[str, Path]:
    """The standard demo/test set: llama and qwen3 targets with one drafter of each layout."""
    paths = {"llama": make_target(out / "llama", "llama"),
             "qwen3": make_target(out / "qwen3", "qwen3", seed=3)}
    paths["aws"] = make_drafter(out / "drafter-aws", paths["llama"], "aws")
    paths["speculators"] = make_drafter(out / "drafter-speculators", paths["qwen3"], "speculators", seed=2)
    paths["eagle3"] = make_drafter(out / "drafter-eagle3", paths["llama"], "eagle3", seed=4)
    return paths


def make_families(out: Path) -> dict[str, Path]:
    """The P-EAGLE target families: Qwen3-MoE, GPT-OSS (also with MXFP4 experts) and Gemma-4 (also
    as the multimodal wrapper and with the MoE block) targets, and an AWS-layout P-EAGLE head for
    each (`drafter-<family>`)."""
    paths = {"qwen3_moe": make_target(out / "qwen3_moe", "qwen3_moe", seed=5),
             "gpt_oss": make_target(out / "gpt_oss", "gpt_oss", seed=6),
             "gpt_oss_mxfp4": make_target(out / "gpt_oss_mxfp4", "gpt_oss", seed=7, mxfp4=True),
             "gemma4": make_target(out / "gemma4", "gemma4", seed=9),
             "gemma4_wrapper": make_target(out / "gemma4_wrapper", "gemma4_wrapper", seed=10),
             "gemma4_moe": make_target(out / "gemma4_moe", "gemma4_moe", seed=11)}
    for family in ("qwen3_moe", "gpt_oss", "gemma4", "gemma4_moe"):
        paths[f"drafter-{family}"] = make_drafter(out / f"drafter-{family}", paths[family], "aws", seed=8)
    return paths
