"""`peagle-trt build`: the parser and handler of the verb; the Triton repository it renders comes
from peagle_trt/build/repository.py. `--target` / `--drafter` take directories or hub ids
(peagle_trt/hub.py); `--drafter` alone with a published head builds it with its card's target.
Tested by tests/build/test_build.py, tests/e2e/test_cli.py and tests/test_hub.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from peagle_trt.config import GRAMMAR_TIMEOUT_S, MAX_GRAMMAR_BYTES
from peagle_trt.errors import ConfigError
from peagle_trt.flags import DETERMINISTIC_HELP, add_kv_flags, add_spec_flags, resolve_spec


def resolve_backend(name: str) -> str:
    """`auto`: TensorRT where it is installed, else onnxruntime (said on stderr, never silently)."""
    if name != "auto":
        return name
    import importlib.util

    if importlib.util.find_spec("tensorrt") is not None:
        return "tensorrt"
    if importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None:
        raise ConfigError("neither TensorRT nor onnxruntime is installed: pip install 'peagle-trt[export]' "
                          "for the onnxruntime backend, or pass --backend torch")
    print("[build] TensorRT is not installed here: using the onnxruntime backend (pass --backend "
          "tensorrt inside an NGC TensorRT container)", file=sys.stderr)
    return "onnxruntime"


def cmd_build(args: argparse.Namespace) -> dict:
    from peagle_trt.build import RepositoryOptions, build_repository

    spec = resolve_spec(args, "build")
    backend = resolve_backend(args.backend)
    repo = RepositoryOptions(spec, args.model_name, backend, args.max_batch, args.max_seq_len,
                    args.prefill_chunk, args.device, args.dtype, args.gpu_arch,
                    str(args.plugin_library) if args.plugin_library else None, kernels=args.kernels,
                    max_prompt_bytes=args.max_prompt_bytes, max_stop_bytes=args.max_stop_bytes,
                    kv_blocks=args.kv_blocks, block_size=args.block_size, prefix_caching=not args.no_prefix_caching,
                    max_grammar_bytes=args.max_grammar_bytes, grammar_timeout_s=args.grammar_timeout,
                    deterministic=args.deterministic, cuda_graphs=not args.no_cuda_graphs,
                    kv_cache_dtype=args.kv_cache_dtype)
    quant = None
    if args.quantization == "fp8":
        from peagle_trt.quantize import QuantizeOptions

        quant = QuantizeOptions(kv_cache_fp8=args.kv_cache_fp8, calib_data=args.calib_data)
    t0 = time.perf_counter()
    manifest = build_repository(args.target, args.drafter, args.output, repo, force=args.force, quant=quant)
    return {"repository": str(args.output), "model": args.model_name, "backend": backend,
            "target": str(args.target), "drafter": str(args.drafter) if args.drafter else None,
            "quantization": args.quantization, "spec_mode": spec.mode,
            "num_spec_tokens": spec.num_spec_tokens, "files": len(manifest["files"]),
            "build_s": round(time.perf_counter() - t0, 3)}


def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("build", help="render a Triton model repository (atomic, with manifest.json)")
    b.add_argument("--target", type=Path, help="target model: a Hugging Face model directory or hub id (org/name, "
                   "optionally @revision); default with a published head as --drafter: the head's target")
    b.add_argument("--drafter", type=Path, help="P-EAGLE or EAGLE-3 drafter: a directory or hub id "
                   "(e.g. amazon/gpt-oss-120b-p-eagle)")
    b.add_argument("--output", required=True, type=Path, help="repository directory to create")
    add_spec_flags(b)
    b.add_argument("--backend", default="auto", choices=["auto", "tensorrt", "onnxruntime", "torch"],
                   help="executor of the served model; auto = tensorrt where installed, else onnxruntime")
    b.add_argument("--model-name", default="peagle", help="Triton model name (default peagle)")
    b.add_argument("--max-batch", type=int, default=8, help="most requests per step (default 8)")
    b.add_argument("--max-seq-len", type=int, default=2048, help="prompt + output tokens (default 2048)")
    add_kv_flags(b)
    b.add_argument("--no-prefix-caching", action="store_true",
                   help="recompute every prompt (default: reuse the KV of cached prompt prefixes)")
    b.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per prefill chunk")
    b.add_argument("--device", default="cpu", help="torch device of the served model (default cpu)")
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    b.add_argument("--max-prompt-bytes", type=int, default=None,
                   help="largest prompt (UTF-8 bytes) a request may send, refused before tokenization "
                        "(default 16 x --max-seq-len)")
    b.add_argument("--max-stop-bytes", type=int, default=None,
                   help="largest total size of a request's stop strings in bytes (default 1024)")
    b.add_argument("--max-grammar-bytes", type=int, default=MAX_GRAMMAR_BYTES,
                   help=f"structured output: largest grammar (JSON schema, regex, EBNF) a request may send, in "
                        f"bytes (default {MAX_GRAMMAR_BYTES})")
    b.add_argument("--grammar-timeout", type=float, default=GRAMMAR_TIMEOUT_S,
                   help=f"structured output: seconds a grammar may take to compile before its request is "
                        f"refused (default {GRAMMAR_TIMEOUT_S:g})")
    b.add_argument("--deterministic", action="store_true",
                   help=DETERMINISTIC_HELP)
    b.add_argument("--kernels", default="reference", choices=["reference", "cuda"],
                   help="torch backend: the custom ops in torch (reference) or on the Triton kernels "
                        "(cuda: needs --device cuda and triton)")
    b.add_argument("--no-cuda-graphs", action="store_true",
                   help="torch backend on CUDA: run every forward eagerly (default: decode, verify and the "
                        "P-EAGLE drafter pass replayed as CUDA graphs per batch bucket)")
    b.add_argument("--quantization", default="none", choices=["none", "fp8"],
                   help="fp8: FP8 (E4M3) post-training quantization of the target with ModelOpt first")
    b.add_argument("--kv-cache-fp8", action="store_true",
                   help="with --quantization fp8: also calibrate the KV scales (k_scale / v_scale) an FP8 KV cache "
                        "(--kv-cache-dtype fp8) uses")
    b.add_argument("--calib-data", type=Path, default=None,
                   help="with --quantization fp8: calibration prompts, JSONL with 'prompt' or 'text' keys")
    b.add_argument("--gpu-arch", default="sm_90", choices=["sm_90", "sm_100"],
                   help="tensorrt backend: sm_90 (H100/H200) or sm_100 (B200); build on that GPU")
    b.add_argument("--plugin-library", type=Path, default=None, help="tensorrt backend: PEagle plugin .so")
    b.add_argument("--force", action="store_true", help="replace a previous peagle-trt output (nothing else)")
    b.set_defaults(func=cmd_build)
    return b
