"""Load a checkpoint pair: read a Hugging Face target and a P-EAGLE / EAGLE-3 drafter, validate the
pair, and build the reference models.

    pair = load_pair(target_dir, drafter_dir, SpecConfig("peagle", 7))
    target, drafter = pair.build(device="cpu")

Only safetensors are read; no pickle, no code from the checkpoint, no trust_remote_code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from peagle_trt.checkpoint.drafter import DrafterCheckpoint, load_drafter
from peagle_trt.checkpoint.target import TargetCheckpoint, load_target
from peagle_trt.checkpoint.validate import validate_pair
from peagle_trt.config import SpecConfig


@dataclass(frozen=True)
class Pair:
    target: TargetCheckpoint
    drafter: DrafterCheckpoint | None
    taps: tuple[int, ...]
    spec: SpecConfig

    def build(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        """(TargetModel, DrafterModel | None) on `device`, weights loaded."""
        from peagle_trt.models.drafter import DrafterModel
        from peagle_trt.models.target import TargetModel

        target = TargetModel.from_tensors(self.target.config, self.target.tensors, self.taps, device, dtype,
                                          f"target {self.target.path}")
        drafter = None
        if self.drafter is not None and self.spec.mode != "none":
            drafter = DrafterModel.from_tensors(self.drafter.config, self.drafter.tensors,
                                                self.target.tensors["embed_tokens.weight"], device, dtype,
                                                f"drafter {self.drafter.path}")
        return target, drafter


def load_pair(target_dir: str | Path, drafter_dir: str | Path | None, spec: SpecConfig) -> Pair:
    """Read and validate a target (and drafter, unless spec mode is 'none')."""
    from peagle_trt.errors import ConfigError

    target = load_target(target_dir)
    if spec.mode == "none":
        return Pair(target, None, (), spec)
    if drafter_dir is None:
        raise ConfigError(f"spec mode {spec.mode!r} needs a drafter: pass --drafter DIR "
                          "(or --spec-mode none)")
    drafter = load_drafter(drafter_dir)
    taps = validate_pair(target.config, drafter, spec)
    return Pair(target, drafter, taps, spec)
