"""Target checkpoints: a Hugging Face model directory (config.json + safetensors) read through
its family adapter into a `TargetConfig` and tensors under our canonical names (per-expert MoE
linears stacked: peagle_trt/checkpoint/experts.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from peagle_trt.architecture import TargetConfig
from peagle_trt.checkpoint.adapters import adapter_for
from peagle_trt.checkpoint.experts import stack_experts
from peagle_trt.checkpoint.safetensors_io import load_tensors, read_config
from peagle_trt.errors import CheckpointError


@dataclass(frozen=True)
class TargetCheckpoint:
    path: Path
    config: TargetConfig
    tensors: dict  # canonical name (no `model.` prefix) -> tensor


def load_target_config(path: str | Path) -> TargetConfig:
    path = Path(path)
    cfg = read_config(path)
    where = f"target {path / 'config.json'}"
    return adapter_for(cfg, where).parse(cfg, where)


def load_target(path: str | Path) -> TargetCheckpoint:
    path = Path(path)
    cfg = read_config(path)
    where = f"target {path / 'config.json'}"
    adapter = adapter_for(cfg, where)
    config = adapter.parse(cfg, where)
    tensors = stack_experts(adapter.convert(load_tensors(path), config, f"target {path}"), f"target {path}")
    if "embed_tokens.weight" not in tensors:
        raise CheckpointError(f"target {path}: tensor 'model.embed_tokens.weight' is missing")
    if "lm_head.weight" not in tensors:
        if not config.tie_word_embeddings:
            raise CheckpointError(f"target {path}: 'lm_head.weight' is missing and "
                                  "tie_word_embeddings is false")
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
    return TargetCheckpoint(path, config, tensors)
