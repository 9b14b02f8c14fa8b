"""Stage `train` (`peagle-trt train`): train a P-EAGLE or EAGLE-3 head for a target.

config.py (TrainConfig), loop.py (`train`, the loop), data.py (corpus, target features), cod.py
(COD sampling, segments), forward.py (the head's training forward and loss), save.py (the trained
head as a checkpoint), source.py (this machine's Python source as data), gpu_recipe.py (the GPU recipe: online
training within a wall budget, the held-out evaluation), cli.py (the subcommand).
"""

from peagle_trt.train.config import METHODS, TrainConfig
from peagle_trt.train.loop import train

__all__ = ["METHODS", "TrainConfig", "train"]
