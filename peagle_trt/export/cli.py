"""`peagle-trt export`: the parser and handler of the verb; the ONNX graphs come from
peagle_trt/export/run.py. Tested by tests/export/.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from peagle_trt.flags import add_kv_flags, add_spec_flags, resolve_spec


def cmd_export(args: argparse.Namespace) -> dict:
    from peagle_trt.export import ExportOptions, export_pair

    spec = resolve_spec(args, "export")
    t0 = time.perf_counter()
    manifest = export_pair(args.target, args.drafter, args.output,
                           ExportOptions(spec, args.max_batch, args.max_seq_len, args.dtype,
                                         kv_blocks=args.kv_blocks, block_size=args.block_size,
                                         kv_cache_dtype=args.kv_cache_dtype), args.force)
    return {"output": str(args.output), "graphs": manifest["graphs"], "export_s": manifest["export_s"],
            "total_s": round(time.perf_counter() - t0, 3)}


def add_parser(sub) -> argparse.ArgumentParser:
    e = sub.add_parser("export", help="write the ONNX graphs with peagle plugin nodes (+ TensorRT copies)")
    e.add_argument("--target", type=Path, help="Hugging Face (or FP8) target: a directory or hub id (default with a "
                   "published head as --drafter: its target)")
    e.add_argument("--drafter", type=Path, help="P-EAGLE or EAGLE-3 drafter: a directory or hub id")
    e.add_argument("--output", required=True, type=Path, help="export directory to create")
    add_spec_flags(e)
    e.add_argument("--max-batch", type=int, default=8, help="most requests per step (default 8)")
    e.add_argument("--max-seq-len", type=int, default=2048, help="prompt + output tokens (default 2048)")
    add_kv_flags(e)
    e.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    e.add_argument("--force", action="store_true", help="replace a previous peagle-trt output (nothing else)")
    e.set_defaults(func=cmd_export)
    return e
