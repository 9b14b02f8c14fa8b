"""`peagle-trt quantize`: the subcommand's parser and handler (wired into peagle_trt/cli.py).

    peagle-trt quantize --target DIR --output DIR [--kv-cache-fp8] [--calib-data FILE.jsonl]
                        [--num-calib N] [--max-calib-len N] [--device cpu|cuda] [--force]

Progress goes to stderr; the handler returns the JSON-able result (cli.main prints it last).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def cmd_quantize(args: argparse.Namespace) -> dict:
    from peagle_trt import hub
    from peagle_trt.quantize import QuantizeOptions, quantize_target

    args.target = hub.resolve(args.target, what="--target")
    spec = QuantizeOptions(kv_cache_fp8=args.kv_cache_fp8, calib_data=args.calib_data, num_calib=args.num_calib,
                     max_calib_len=args.max_calib_len, device=args.device)
    t0 = time.perf_counter()
    manifest = quantize_target(args.target, args.output, spec, force=args.force)
    q = manifest["quantization"]
    return {"output": str(args.output), "quantization": "fp8", "kv_cache": q["kv_cache"],
            "fp8_layers": q["fp8_layers"], "calibration": manifest["calibration"],
            "files": len(manifest["files"]), "quantize_s": round(time.perf_counter() - t0, 3)}


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `quantize` on the `peagle-trt` subparsers (sets func=cmd_quantize)."""
    q = sub.add_parser("quantize", help="FP8 post-training quantization of the target (NVIDIA ModelOpt)")
    q.add_argument("--target", required=True, type=Path, help="target model: a Hugging Face model directory or hub id")
    q.add_argument("--output", required=True, type=Path, help="directory for the FP8 checkpoint")
    q.add_argument("--kv-cache-fp8", action="store_true",
                   help="also calibrate FP8 KV-cache scales (k_scale / v_scale)")
    q.add_argument("--calib-data", type=Path, default=None,
                   help='JSONL, one {"prompt": ...} (chat-formatted) or {"text": ...} (raw) per line; '
                        "default: a small built-in prompt set")
    q.add_argument("--num-calib", type=int, default=64, help="calibration samples (default 64)")
    q.add_argument("--max-calib-len", type=int, default=512, help="tokens per sample (default 512)")
    q.add_argument("--device", default="cpu", help="calibration device (default cpu; cuda if available)")
    q.add_argument("--force", action="store_true", help="replace a previous peagle-trt output (nothing else)")
    q.set_defaults(func=cmd_quantize)
    return q
