"""`peagle-trt engine`: the command line of the TensorRT build stage (wired into peagle_trt/cli.py).

    peagle-trt engine --export-dir EXPORT --output ENGINES --gpu-arch sm_90 \\
        [--plugin-library LIB.so] [--max-batch 8] [--max-seq-len 2048] [--num-spec-tokens 7] \\
        [--prefill-chunk 256] [--block-size 32] [--kv-blocks 0] [--workspace-gb 8] [--timing-cache PATH] \\
        [--allow-arch-mismatch]

Runs only where TensorRT is installed (NGC containers, docker/); elsewhere it exits with a message
naming the container. The last stdout line (printed by peagle_trt/cli.py) is the returned dict.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

PLUGIN_ENV = "PEAGLE_TRT_PLUGIN_LIBRARY"  # default --plugin-library (set by docker/Dockerfile)


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `engine` on an argparse subparsers object; sets func=cmd_engine."""
    from peagle_trt.config import BLOCK_SIZE
    from peagle_trt.engine import ARCHES

    e = sub.add_parser("engine", help="build TensorRT plans from an export directory (needs TensorRT + GPU)")
    e.add_argument("--export-dir", required=True, type=Path, help="export directory (holds trt/*.onnx)")
    e.add_argument("--output", required=True, type=Path,
                   help="engine directory; plans of other GPU architectures already there are kept")
    e.add_argument("--gpu-arch", required=True, choices=sorted(ARCHES),
                   help="sm_90 (build on H100/H200) or sm_100 (build on B200): TensorRT builds for the GPU "
                        "it runs on")
    e.add_argument("--plugin-library", type=Path, default=os.environ.get(PLUGIN_ENV) or None,
                   help=f"PEagle TensorRT plugin library (.so built from plugins/; default ${PLUGIN_ENV})")
    e.add_argument("--max-batch", type=int, default=8, help="concurrent requests per forward (default 8)")
    e.add_argument("--max-seq-len", type=int, default=2048, help="prompt + output tokens (default 2048)")
    e.add_argument("--num-spec-tokens", type=int, default=7, help="K, as exported (default 7)")
    e.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per prefill (default 256)")
    e.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                   help=f"positions per KV block, as exported (default {BLOCK_SIZE})")
    e.add_argument("--kv-blocks", type=int, default=0,
                   help="KV blocks, as exported (default 0: --max-batch requests of the full length)")
    e.add_argument("--workspace-gb", type=float, default=8.0, help="builder workspace in GiB (default 8)")
    e.add_argument("--timing-cache", type=Path, default=None,
                   help="persistent timing cache (default ~/.cache/peagle-trt/timing-<arch>.cache)")
    e.add_argument("--allow-arch-mismatch", action="store_true",
                   help="build on a GPU of another architecture as an Ampere+ hardware-compatible plan "
                        "(slower; the plugin library must hold kernels for --gpu-arch)")
    e.set_defaults(func=cmd_engine)
    return e


def cmd_engine(args: argparse.Namespace) -> dict:
    from peagle_trt.engine import EngineOptions, build_engines

    spec = EngineOptions(args.gpu_arch, args.max_batch, args.max_seq_len, args.num_spec_tokens,
                      args.prefill_chunk, Path(args.plugin_library) if args.plugin_library else None,
                      args.workspace_gb, args.timing_cache, args.allow_arch_mismatch,
                      block_size=args.block_size, kv_blocks=args.kv_blocks)
    t0 = time.perf_counter()
    manifest = build_engines(args.export_dir, args.output, spec)
    entry = manifest["engines"][spec.gpu_arch]
    return {"engines": str(args.output), "gpu_arch": spec.gpu_arch, "gpu_name": manifest["gpu_name"],
            "tensorrt_version": manifest["tensorrt_version"], "cuda_version": manifest["cuda_version"],
            "plans": [g["plan"] for g in entry["graphs"].values()],
            "build_s": round(time.perf_counter() - t0, 1)}
