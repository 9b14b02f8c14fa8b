"""`peagle-trt make-tiny OUT_DIR`: the parser and handler of the verb; the small seeded checkpoints
come from peagle_trt/make_tiny/checkpoints.py. Tested by tests/e2e/test_cli.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_make_tiny(args: argparse.Namespace) -> dict:
    from peagle_trt.make_tiny.checkpoints import make_all, make_families

    paths = make_all(args.out)
    if args.families:
        paths.update(make_families(args.out))
    return {k: str(v) for k, v in paths.items()}


def add_parser(sub) -> argparse.ArgumentParser:
    t = sub.add_parser("make-tiny", help="write small seeded checkpoints (targets + drafters)")
    t.add_argument("out", type=Path, help="output directory")
    t.add_argument("--families", action="store_true",
                   help="also Qwen3-MoE, GPT-OSS (+ MXFP4) and Gemma-4 (+ wrapper) targets with P-EAGLE heads")
    t.set_defaults(func=cmd_make_tiny)
    return t
