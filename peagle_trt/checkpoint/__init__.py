"""Stage 1, checkpoint: read and validate a Hugging Face target and a P-EAGLE / EAGLE-3 drafter.

    pair = load_pair(target_dir, drafter_dir, SpecConfig("peagle", 7))
    target, drafter = pair.build(device="cpu")

Only safetensors are read; no pickle, no code from the checkpoint, no trust_remote_code.
peagle_trt/checkpoint/load.py (the pair loaded), target.py / drafter.py (each side), validate.py (do
they fit), adapters/ (one per target family), safetensors_io.py, mxfp4.py. `peagle-trt inspect`
reads them: peagle_trt/inspect/cli.py.
"""

from peagle_trt.checkpoint.drafter import DrafterCheckpoint, DrafterConfig, load_drafter
from peagle_trt.checkpoint.load import Pair, load_pair
from peagle_trt.checkpoint.target import TargetCheckpoint, load_target

__all__ = ["DrafterCheckpoint", "DrafterConfig", "Pair", "TargetCheckpoint", "load_drafter",
           "load_pair", "load_target"]
