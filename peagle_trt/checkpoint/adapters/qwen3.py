"""Qwen3 dense: Llama plus per-head RMSNorm on q and k; sliding-window layers are refused."""

from peagle_trt.checkpoint.adapters.base import TargetAdapter
from peagle_trt.errors import ConfigError


class Qwen3Adapter(TargetAdapter):
    name = "qwen3"
    model_types = ("qwen3",)
    qk_norm = True

    def extra_fields(self, cfg: dict, where: str) -> dict:
        if cfg.get("use_sliding_window"):
            raise ConfigError(f"{where}: use_sliding_window=true is not supported yet; "
                              "serve this model with full attention (use_sliding_window=false)")
        return {}
