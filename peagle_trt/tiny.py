"""Small seeded checkpoints in the real on-disk layouts, for tests and the CPU demo.

Targets are real transformers models (LlamaForCausalLM / Qwen3ForCausalLM) built from their
config classes and saved with `save_pretrained`, plus a byte-level BPE tokenizer with a ChatML
chat template. Drafters are written in the AWS P-EAGLE layout (`midlayer.*`, `mask_hidden`,
`ptd_token_id`, `d2t`/`t2d` with a smaller draft vocabulary), the `speculators` layout, and as a
plain EAGLE-3 head. Weights are random: acceptance of these drafters is low by construction.

    python scripts/make_tiny_models.py OUT_DIR
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


def make_tokenizer(out: Path) -> dict[str, int]:
    """Train a tiny byte-level BPE tokenizer and save it (with a chat template) into `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 64, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=SPECIAL[1:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return {t: tok.token_to_id(t) for t in SPECIAL}


def make_target(out: Path, family: str = "llama", seed: int = 0, layers: int = 8,
                rope: dict | None = None, shard: bool = False) -> Path:
    """A random `family` target ("llama" or "qwen3") with tokenizer, saved to `out`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    ids = make_tokenizer(out)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, initializer_range=0.1, eos_token_id=ids["<|endoftext|>"],
                  bos_token_id=None, pad_token_id=ids["<|endoftext|>"])
    if family == "llama":
        rope = rope or {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 256}
        config, cls = LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False), LlamaForCausalLM
    elif family == "qwen3":
        rope = rope or {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 8.0,
                        "original_max_position_embeddings": 512}
        config, cls = Qwen3Config(**common, rope_parameters=rope, tie_word_embeddings=True), Qwen3ForCausalLM
    else:
        raise ValueError(f"unknown family {family!r}")
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # non-trivial norm weights so a missing or misplaced norm shows up
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(out, max_shard_size="200KB" if shard else "10GB")
    return out


def drafter_tensors(target_dir: Path, layers: int, draft_vocab: int, seed: int,
                    speculators: bool, mask_hidden: bool) -> tuple[dict, dict]:
    """Random drafter weights (canonical names) and the config fields they imply."""
    from peagle_trt.checkpoint.drafter import DrafterConfig
    from peagle_trt.models.drafter import DrafterModel
    from peagle_trt.models.rope import RopeConfig

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
                 draft_vocab: int = 384) -> Path:
    """A random drafter for the target in `target_dir`; layout: aws | speculators | eagle3."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors, _ = drafter_tensors(target_dir, layers, draft_vocab, seed, layout == "speculators",
                                 layout != "eagle3")
    mask_id = json.loads((target_dir / "tokenizer.json").read_text())["added_tokens"]
    mask_id = next(t["id"] for t in mask_id if t["content"] == MASK_TOKEN)
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
