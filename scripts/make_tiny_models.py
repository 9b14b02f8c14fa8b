#!/usr/bin/env python3
"""Write small seeded checkpoints in the real layouts: targets (Llama, Qwen3, with tokenizer) and
drafters (AWS P-EAGLE, speculators P-EAGLE, plain EAGLE-3). Usage: make_tiny_models.py OUT_DIR"""

import argparse
import json
from pathlib import Path

from peagle_trt.tiny import make_all

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path, help="directory to write the checkpoints into")
    paths = make_all(parser.parse_args().out)
    print(json.dumps({k: str(v) for k, v in paths.items()}))
