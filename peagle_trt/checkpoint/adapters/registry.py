"""Registry of target-architecture adapters, keyed by config.json `model_type`.

Adding a family = one module with a `TargetAdapter` subclass + one line here.
"""

from __future__ import annotations

from peagle_trt.checkpoint.adapters.base import TargetAdapter
from peagle_trt.checkpoint.adapters.gemma4 import Gemma4Adapter
from peagle_trt.checkpoint.adapters.gpt_oss import GptOssAdapter
from peagle_trt.checkpoint.adapters.llama import LlamaAdapter
from peagle_trt.checkpoint.adapters.qwen3 import Qwen3Adapter
from peagle_trt.checkpoint.adapters.qwen3_moe import Qwen3MoeAdapter
from peagle_trt.errors import ConfigError

ADAPTERS: dict[str, TargetAdapter] = {
    model_type: adapter for adapter in (LlamaAdapter(), Qwen3Adapter(), Qwen3MoeAdapter(), GptOssAdapter(),
                                     Gemma4Adapter())
    for model_type in adapter.model_types
}


def adapter_for(cfg: dict, where: str) -> TargetAdapter:
    model_type = cfg.get("model_type")
    if model_type is None:
        raise ConfigError(f"{where}: required key 'model_type' is missing")
    if model_type not in ADAPTERS:
        raise ConfigError(f"{where}: target model_type {model_type!r} is not supported; "
                          f"supported: {sorted(ADAPTERS)}")
    return ADAPTERS[model_type]

