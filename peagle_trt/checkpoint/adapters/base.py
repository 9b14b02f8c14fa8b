"""The resolved target architecture (`TargetConfig`) and the adapter base class.

An adapter turns one family's `config.json` into a `TargetConfig` and maps its tensor names
onto ours. Family differences live in the adapters (llama.py, qwen3.py); generic code only sees
`TargetConfig` fields.
"""

from __future__ import annotations

from peagle_trt.architecture import RopeConfig, TargetConfig
from peagle_trt.errors import ConfigError


def require(cfg: dict, key: str, where: str):
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{where}: required key {key!r} is missing; a Hugging Face config.json "
                          f"of this model family always has it")
    return cfg[key]


def token_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def quantization(cfg: dict, where: str) -> str | None:
    """config.json `quantization_config` -> None or "fp8": ModelOpt FP8 (as `peagle-trt quantize` writes
    it) or 128 x 128 block-scaled FP8 with dynamic activations (`quant_method: fp8`, `weight_block_size:
    [128, 128]`: Qwen3-Coder-30B-A3B-Instruct-FP8's); the weights load through peagle_trt/models/fp8.py
    and peagle_trt/models/moe.py."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    algo = q.get("quant_algo") if isinstance(q, dict) else None
    if method == "modelopt" and str(algo).upper() == "FP8":
        return "fp8"
    if method == "fp8":
        block, scheme, fmt = q.get("weight_block_size"), q.get("activation_scheme", "dynamic"), q.get("fmt", "e4m3")
        if list(block or []) == [128, 128] and scheme == "dynamic" and fmt == "e4m3":
            return "fp8"
        raise ConfigError(f"{where}: FP8 quantization_config with weight_block_size={block!r}, activation_scheme="
                          f"{scheme!r}, fmt={fmt!r} is not supported; supported: 128 x 128 E4M3 blocks with dynamic "
                          "activations, or ModelOpt per-tensor FP8 (`peagle-trt quantize`)")
    raise ConfigError(f"{where}: quantization_config (quant_method={method!r}, quant_algo={algo!r}) is "
                      "not supported; supported: ModelOpt per-tensor FP8 as written by `peagle-trt "
                      "quantize`, and 128 x 128 block-scaled FP8 (quant_method fp8). Start from the unquantized "
                      "checkpoint and run `peagle-trt quantize`")


class TargetAdapter:
    """Llama-family parsing; subclasses override the class attributes or `extra_fields`."""

    name = "llama"
    model_types: tuple[str, ...] = ("llama",)
    qk_norm = False
    weight_prefix = "model."

    hidden_act = "silu"

    def parse(self, cfg: dict, where: str) -> TargetConfig:
        self.check_activation(cfg, where)
        hidden = int(require(cfg, "hidden_size", where))
        heads = int(require(cfg, "num_attention_heads", where))
        return TargetConfig(
            arch=self.name,
            vocab_size=int(require(cfg, "vocab_size", where)),
            hidden_size=hidden,
            num_layers=int(require(cfg, "num_hidden_layers", where)),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(require(cfg, "intermediate_size", where)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(cfg, where),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=self.qk_norm,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=token_ids(cfg.get("eos_token_id")),
            quantization=self.quantization(cfg, where),
            **self.extra_fields(cfg, where),
        )

    def check_activation(self, cfg: dict, where: str) -> None:
        act = cfg.get("hidden_act", "silu")
        if act != self.hidden_act:
            raise ConfigError(f"{where}: hidden_act {act!r} is not supported (expected {self.hidden_act!r})")

    def extra_fields(self, cfg: dict, where: str) -> dict:
        return {}

    def quantization(self, cfg: dict, where: str) -> str | None:
        return quantization(cfg, where)

    def convert(self, tensors: dict, config: TargetConfig, where: str) -> dict:
        """Checkpoint tensors -> our canonical names and layouts (default: `our_name` renames)."""
        out = {}
        for name, tensor in tensors.items():
            ours = self.our_name(name)
            if ours is not None:
                out[ours] = tensor
        return out

    def our_name(self, hf_name: str) -> str | None:
        """Our parameter name for a checkpoint tensor (None: not a weight we use)."""
        if hf_name.startswith(self.weight_prefix):
            return hf_name[len(self.weight_prefix):]
        return hf_name if hf_name.startswith("lm_head.") else None
