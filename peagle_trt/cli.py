"""`peagle-trt`: the command line. Each subcommand's LAST stdout line is one JSON object.

    peagle-trt generate --target DIR --drafter DIR --prompt TEXT [--spec-mode peagle] ...
    peagle-trt demo                     # the main job on a CPU machine (the trained code pair)
    peagle-trt train --target DIR --output DIR --text-list FILES   # train a P-EAGLE / EAGLE-3 head
    peagle-trt convert --gguf FILE.gguf --output DIR   # a GGUF model -> a target directory
    peagle-trt make-tiny OUT_DIR        # small seeded checkpoints for demos and tests
    peagle-trt inspect [TARGET_DIR] DRAFTER_DIR   # what a checkpoint is; whether a pair fits
    peagle-trt bench SUITE [options]    # a benchmark suite (peagle-trt bench --help lists them)
    peagle-trt dynamo worker|frontend   # serve behind NVIDIA Dynamo (many machines, KV-aware routing)

This is the only module that catches broad exceptions: it prints them and exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

from peagle_trt.config import BLOCK_SIZE, GRAMMAR_TIMEOUT_S, MAX_GRAMMAR_BYTES, SPEC_MODES, SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError, PeagleError

DETERMINISTIC_HELP = ("row- and batch-invariant forwards: a request's output does not depend on its batch, draft "
                      "count or thread count (torch / onnxruntime backends; docs/SERVING.md, Deterministic mode)")


def resolve_spec(args: argparse.Namespace, purpose: str = "generate") -> SpecConfig:
    """Spec config from --speculative-config (else $SM_VLLM_SPECULATIVE_CONFIG) and/or --spec-mode /
    --num-spec-tokens. The JSON's "model" fills --drafter when that is not given."""
    from peagle_trt import speculative_config

    parsed = speculative_config.resolve(args.speculative_config, purpose)
    if parsed is not None:
        spec = parsed.spec
        if parsed.model is not None:
            if args.drafter is None:
                args.drafter = Path(parsed.model)
            elif Path(parsed.model).resolve() != Path(args.drafter).resolve():
                raise ConfigError(f"--drafter {args.drafter} contradicts \"model\": {parsed.model!r} of the "
                                  "speculative config; pass one of them")
        if args.spec_mode not in (None, spec.mode):
            raise ConfigError(f"--spec-mode {args.spec_mode} contradicts the speculative config "
                              f"(which means {spec.mode}); pass one of them")
        if args.num_spec_tokens not in (None, spec.num_spec_tokens):
            raise ConfigError(f"--num-spec-tokens {args.num_spec_tokens} contradicts "
                              f"num_speculative_tokens={spec.num_spec_tokens} in the speculative config")
        if spec.synthetic_rates and not getattr(args, "allow_synthetic_acceptance", False):
            raise ConfigError("rejection_sample_method 'synthetic' accepts drafts whatever their tokens: the "
                              "output is NOT the target's. It is for benchmarks (peagle-trt bench synthetic); "
                              "pass --allow-synthetic-acceptance to force it here")
        return spec
    mode = args.spec_mode
    if mode is None:  # default: P-EAGLE when the head has mask_hidden, else EAGLE-3, else none
        from peagle_trt.checkpoint.safetensors_io import tensor_names

        if args.drafter is None:
            mode = "none"
        else:
            names = tensor_names(Path(args.drafter))
            mode = "peagle" if {"mask_hidden", "model.mask_hidden"} & names else "eagle3"
    if args.num_spec_tokens is not None and args.num_spec_tokens < 1 and mode != "none":
        raise ConfigError(f"--num-spec-tokens must be >= 1, got {args.num_spec_tokens}; pass --spec-mode none "
                          "to generate without speculation")
    return SpecConfig(mode, 7 if args.num_spec_tokens is None else max(args.num_spec_tokens, 1))


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos,
                          stop=tuple(args.stop or ()), structured=_structured(args))


def _structured(args: argparse.Namespace):
    """`generate --json-schema FILE | --regex R | --choice A B .. | --grammar FILE` (one of them)."""
    from peagle_trt.config import StructuredOutput

    given = {k: v for k, v in (("json", args.json_schema), ("regex", args.regex), ("choice", args.choice),
                               ("grammar", args.grammar)) if v is not None}
    if len(given) > 1:
        raise ConfigError(f"pass at most one of --json-schema, --regex, --choice, --grammar (got {len(given)})")
    if not given:
        return None
    (kind, value), = given.items()
    if kind in ("json", "grammar"):
        try:
            value = Path(value).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read --{'json-schema' if kind == 'json' else 'grammar'} {value}: {exc}") from exc
    return StructuredOutput.from_dict({kind: value})


def _print_piece(piece: str) -> None:
    print(piece, end="", flush=True)


def cmd_generate(args: argparse.Namespace) -> dict:
    """One request, streamed to stdout, through the text generator (in-process from checkpoints or
    a built repository) or a running server (gRPC); the same JSON shape for all three."""
    sources = [x for x in (args.target, args.url, args.repo) if x is not None]
    if len(sources) != 1:
        raise ConfigError("pass exactly one of --target DIR (in-process from checkpoints), "
                          "--repo REPO (in-process from a built repository) or --url HOST:PORT (gRPC)")
    if args.url and args.deterministic:
        raise ConfigError("--deterministic is the server's setting: start it with `peagle-trt serve --deterministic` "
                          "(or build the repository with --deterministic); --url only sends the request")
    params, chat_template = _sampling(args), not args.no_chat_template
    t0 = time.perf_counter()
    generator = None if args.url else _load_generator(args)
    t1 = time.perf_counter()
    if generator is None:
        from peagle_trt.serving.client import stream_generate

        result = stream_generate(args.url, args.prompt, params, args.model, _print_piece, chat_template)
    else:
        result = generator.generate(args.prompt, params, lambda event: _print_piece(event.text), chat_template)
    t2 = time.perf_counter()
    print(flush=True)
    n = len(result["token_ids"])
    return {**result, "load_s": round(t1 - t0, 3), "generate_s": round(t2 - t1, 3),
            "tokens_per_s": round(n / (t2 - t1), 2) if t2 > t1 else None}


def _load_generator(args: argparse.Namespace):
    from peagle_trt.serving.generator import TextGenerator

    if args.repo:
        from peagle_trt.serving.options import read_options, with_deterministic

        model_dir, options, paths = read_options(args.repo, args.model)
        return TextGenerator.load(model_dir, with_deterministic(options, args.deterministic), paths)
    spec = resolve_spec(args)  # first: the config's "model" may name the drafter (args.drafter)
    backend = generate_backend(args)

    def load(name: str):
        return TextGenerator.from_checkpoints(args.target, args.drafter, spec, args.device,
                                               args.dtype, args.max_seq_len, backend=name,
                                               deterministic=args.deterministic)

    if backend == "onnxruntime" and args.backend == "auto":
        from peagle_trt.errors import BuildError

        try:
            return load(backend)
        except BuildError as exc:  # a model the ONNX graphs cannot express yet (e.g. FP8 MoE experts)
            print(f"[generate] onnxruntime cannot run this model ({exc}); using torch", file=sys.stderr)
            backend = "torch"
    return load(backend)


def generate_backend(args: argparse.Namespace) -> str:
    """`generate --target --backend auto`: onnxruntime (MLAS GEMMs, KV in place; the graphs made
    in memory) for float32 on CPU where onnxruntime is installed, else torch. Measured in
    docs/BENCHMARKS.md, "SmolLM2-135M: decode speed"."""
    if args.backend != "auto":
        return args.backend
    import importlib.util

    on_cpu = args.device == "cpu" and args.dtype == "float32"
    installed = all(importlib.util.find_spec(m) is not None for m in ("onnxruntime", "onnx"))
    return "onnxruntime" if on_cpu and installed else "torch"


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


def cmd_export(args: argparse.Namespace) -> dict:
    from peagle_trt.export import ExportOptions, export_pair

    spec = resolve_spec(args, "export")
    t0 = time.perf_counter()
    manifest = export_pair(args.target, args.drafter, args.output,
                           ExportOptions(spec, args.max_batch, args.max_seq_len, args.dtype,
                                         kv_blocks=args.kv_blocks, block_size=args.block_size), args.force)
    return {"output": str(args.output), "graphs": manifest["graphs"], "export_s": manifest["export_s"],
            "total_s": round(time.perf_counter() - t0, 3)}


def cmd_build(args: argparse.Namespace) -> dict:
    from peagle_trt.repository import RepositoryOptions, build_repository

    spec = resolve_spec(args, "build")
    backend = resolve_backend(args.backend)
    repo = RepositoryOptions(spec, args.model_name, backend, args.max_batch, args.max_seq_len,
                    args.prefill_chunk, args.device, args.dtype, args.gpu_arch,
                    str(args.plugin_library) if args.plugin_library else None, kernels=args.kernels,
                    max_prompt_bytes=args.max_prompt_bytes, max_stop_bytes=args.max_stop_bytes,
                    kv_blocks=args.kv_blocks, block_size=args.block_size, prefix_caching=not args.no_prefix_caching,
                    max_grammar_bytes=args.max_grammar_bytes, grammar_timeout_s=args.grammar_timeout,
                    deterministic=args.deterministic, cuda_graphs=not args.no_cuda_graphs)
    quant = None
    if args.quantization == "fp8":
        from peagle_trt.quantize import QuantizeOptions

        quant = QuantizeOptions(kv_cache_fp8=args.kv_cache_fp8, calib_data=args.calib_data)
    t0 = time.perf_counter()
    manifest = build_repository(args.target, args.drafter, args.output, repo, force=args.force, quant=quant)
    return {"repository": str(args.output), "model": args.model_name, "backend": backend,
            "quantization": args.quantization, "spec_mode": spec.mode,
            "num_spec_tokens": spec.num_spec_tokens, "files": len(manifest["files"]),
            "build_s": round(time.perf_counter() - t0, 3)}


def _serve_spec(args: argparse.Namespace) -> str | None:
    """The serve-time speculative config (flag, else $SM_VLLM_SPECULATIVE_CONFIG) over the built
    one of every model of the repository, checked before anything starts; its vLLM JSON for the
    Triton models, or None."""
    from peagle_trt import speculative_config
    from peagle_trt.serving.options import read_options

    parsed = speculative_config.resolve(args.speculative_config, "serve")
    if parsed is None:
        return None
    for config in sorted(Path(args.repo).glob("*/config.pbtxt")):
        try:
            spec = speculative_config.for_built(read_options(args.repo, config.parent.name)[1].speculation, parsed)
        except ConfigError as exc:
            raise ConfigError(f"model {config.parent.name!r}: {exc}") from None
    if spec.synthetic_rates and not args.allow_synthetic_acceptance:
        raise ConfigError("rejection_sample_method 'synthetic' accepts drafts whatever their tokens: the output "
                          "is NOT the target's; pass --allow-synthetic-acceptance to force it (benchmarks only)")
    return json.dumps(speculative_config.to_vllm(spec))


def cmd_serve(args: argparse.Namespace) -> dict:
    from peagle_trt.serving.server import ServeOptions, serve_forever

    if args.deterministic:  # refused before anything starts where a model's backend cannot be (tensorrt)
        from peagle_trt.serving.options import read_options, with_deterministic

        for config in sorted(Path(args.repo).glob("*/config.pbtxt")):
            with_deterministic(read_options(args.repo, config.parent.name)[1], True)
    options = ServeOptions(args.repo, args.host, args.http_port, args.grpc_port, args.metrics_port,
                           args.ready_timeout, drain_timeout_s=args.drain_timeout,
                           speculative_config=_serve_spec(args), deterministic=args.deterministic,
                           log_path=args.log)

    frontend = None
    if args.openai_port:  # bound before tritonserver starts; answers 503 until the model is ready
        from peagle_trt.openai_frontend import FrontendOptions, OpenAIFrontend

        grpc_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host  # reach Triton locally
        frontend = OpenAIFrontend(FrontendOptions(args.repo, f"{grpc_host}:{args.grpc_port}", args.host,
                                                  args.openai_port,
                                                  spec_metrics=args.per_request_spec_decode_metrics)).start()

    def on_ready(server):
        print(json.dumps({"ready": True, "http": server.http_url, "grpc": server.grpc_url,
                          "metrics": f"http://{args.host}:{args.metrics_port}/metrics",
                          "openai": frontend.url if frontend else None,
                          "log": str(server.log_path)}), flush=True)
        print("serving; Ctrl-C to stop", file=sys.stderr, flush=True)

    try:
        return {"stopped": True, **serve_forever(options, on_ready)}
    finally:
        if frontend is not None:
            frontend.stop()


def cmd_make_tiny(args: argparse.Namespace) -> dict:
    from peagle_trt.tiny import make_all, make_families

    paths = make_all(args.out)
    if args.families:
        paths.update(make_families(args.out))
    return {k: str(v) for k, v in paths.items()}


def _spec_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec-mode", choices=SPEC_MODES, default=None,
                   help="none | eagle3 (K sequential drafter passes) | peagle (one parallel pass); "
                        "default: peagle if the drafter has mask_hidden, else eagle3")
    p.add_argument("--num-spec-tokens", type=int, default=None, help="K, draft tokens per step (default 7)")
    p.add_argument("--speculative-config", default=None,
                   help='vLLM form, e.g. \'{"method":"eagle3","num_speculative_tokens":7,'
                        '"parallel_drafting":true}\' (default: $SM_VLLM_SPECULATIVE_CONFIG); keys: README.md')
    p.add_argument("--allow-synthetic-acceptance", action="store_true",
                   help="accept a synthetic rejection_sample_method (benchmarks only: output is not the target's)")


def add_generate_parser(sub) -> argparse.ArgumentParser:
    g = sub.add_parser("generate", help="generate text in-process (streams text, JSON last line)")
    g.add_argument("--target", type=Path, help="Hugging Face target model directory (in-process)")
    g.add_argument("--drafter", type=Path, help="P-EAGLE or EAGLE-3 drafter directory")
    g.add_argument("--repo", type=Path, help="a built model repository, run in-process")
    g.add_argument("--url", help="HOST:PORT of a running server's gRPC endpoint (streaming client)")
    g.add_argument("--model", default="peagle", help="model name in the repository (default peagle)")
    g.add_argument("--prompt", required=True, help="prompt text")
    _spec_flags(g)
    g.add_argument("--max-tokens", type=int, default=128, help="maximum generated tokens (default 128)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); below 1e-5 also samples greedily (SamplingParams)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="top-k filter, 0 = off (default)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    g.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    g.add_argument("--json-schema", type=Path, help="structured output: a JSON schema file the output follows")
    g.add_argument("--regex", help="structured output: a regular expression the output matches")
    g.add_argument("--choice", nargs="+", help="structured output: the output is exactly one of these strings")
    g.add_argument("--grammar", type=Path, help="structured output: an EBNF (root ::= ...) or Lark grammar file")
    g.add_argument("--device", default="cpu", help="torch device (default cpu)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weight dtype (default float32)")
    g.add_argument("--max-seq-len", type=int, default=4096,
                   help="with --target: prompt + output tokens the KV cache holds (default 4096)")
    g.add_argument("--deterministic", action="store_true",
                   help=DETERMINISTIC_HELP)
    g.add_argument("--backend", default="auto", choices=["auto", "torch", "onnxruntime"],
                   help="with --target: auto (default) = onnxruntime for float32 on CPU (fastest there), "
                        "else torch")
    g.set_defaults(func=cmd_generate)
    return g


def add_build_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("build", help="render a Triton model repository (atomic, with manifest.json)")
    b.add_argument("--target", required=True, type=Path, help="Hugging Face target model directory")
    b.add_argument("--drafter", type=Path, help="P-EAGLE or EAGLE-3 drafter directory")
    b.add_argument("--output", required=True, type=Path, help="repository directory to create")
    _spec_flags(b)
    b.add_argument("--backend", default="auto", choices=["auto", "tensorrt", "onnxruntime", "torch"],
                   help="executor of the served model; auto = tensorrt where installed, else onnxruntime")
    b.add_argument("--model-name", default="peagle", help="Triton model name (default peagle)")
    b.add_argument("--max-batch", type=int, default=8, help="most requests per step (default 8)")
    b.add_argument("--max-seq-len", type=int, default=2048, help="prompt + output tokens (default 2048)")
    _kv_flags(b)
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
    b.add_argument("--kv-cache-fp8", action="store_true", help="with --quantization fp8: also calibrate KV scales")
    b.add_argument("--calib-data", type=Path, default=None,
                   help="with --quantization fp8: calibration prompts, JSONL with 'prompt' or 'text' keys")
    b.add_argument("--gpu-arch", default="sm_90", choices=["sm_90", "sm_100"],
                   help="tensorrt backend: sm_90 (H100/H200) or sm_100 (B200); build on that GPU")
    b.add_argument("--plugin-library", type=Path, default=None, help="tensorrt backend: PEagle plugin .so")
    b.add_argument("--force", action="store_true", help="replace a previous peagle-trt output (nothing else)")
    b.set_defaults(func=cmd_build)
    return b


def _kv_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-blocks", type=int, default=0,
                   help="KV cache blocks (full-attention layers and drafter); requests hold the blocks their "
                        "tokens need (default 0: room for --max-batch requests of --max-seq-len)")
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE, help=f"positions per KV block (default {BLOCK_SIZE})")


def add_export_parser(sub) -> argparse.ArgumentParser:
    e = sub.add_parser("export", help="write the ONNX graphs with peagle plugin nodes (+ TensorRT copies)")
    e.add_argument("--target", required=True, type=Path, help="Hugging Face (or FP8) target directory")
    e.add_argument("--drafter", type=Path, help="P-EAGLE or EAGLE-3 drafter directory")
    e.add_argument("--output", required=True, type=Path, help="export directory to create")
    _spec_flags(e)
    e.add_argument("--max-batch", type=int, default=8, help="most requests per step (default 8)")
    e.add_argument("--max-seq-len", type=int, default=2048, help="prompt + output tokens (default 2048)")
    _kv_flags(e)
    e.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    e.add_argument("--force", action="store_true", help="replace a previous peagle-trt output (nothing else)")
    e.set_defaults(func=cmd_export)
    return e


def add_serve_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="serve a model repository with tritonserver until Ctrl-C")
    s.add_argument("repo", type=Path, help="model repository built by `peagle-trt build`")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for readiness")
    s.add_argument("--log", type=Path, default=None,
                   help="tritonserver's log (default: a temporary file, removed after a clean stop, kept "
                        "and named after a failure)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM / Ctrl-C, seconds running streams may take to finish (default 30); "
                        "a second signal stops at once")
    s.add_argument("--openai-port", type=int, default=None,
                   help="also serve OpenAI-compatible /v1/... on this port (same --host); off by default")
    s.add_argument("--per-request-spec-decode-metrics", choices=("none", "summary", "detailed"), default="summary",
                   help="vLLM's per-response metrics.speculative_decoding on the OpenAI API (default summary; "
                        "detailed adds per-step lists)")
    s.add_argument("--deterministic", action="store_true",
                   help=DETERMINISTIC_HELP + "; every model of the repository (sets VLLM_BATCH_INVARIANT=1 for them)")
    s.add_argument("--speculative-config", default=None,
                   help="run-time keys over the built config (default: $SM_VLLM_SPECULATIVE_CONFIG): "
                        "num_speculative_tokens_per_batch_size, adaptive_num_speculative_tokens, synthetic "
                        "acceptance; method and K must be the built ones")
    s.add_argument("--allow-synthetic-acceptance", action="store_true",
                   help="accept a synthetic rejection_sample_method (benchmarks only: output is not the target's)")
    s.set_defaults(func=cmd_serve)
    return s


def add_make_tiny_parser(sub) -> argparse.ArgumentParser:
    t = sub.add_parser("make-tiny", help="write small seeded checkpoints (targets + drafters)")
    t.add_argument("out", type=Path, help="output directory")
    t.add_argument("--families", action="store_true",
                   help="also Qwen3-MoE, GPT-OSS (+ MXFP4) and Gemma-4 (+ wrapper) targets with P-EAGLE heads")
    t.set_defaults(func=cmd_make_tiny)
    return t


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand is wired the same way: an `add_parser(sub)` beside its command (the stages'
    own cli.py modules, or this module's for the ones without a stage package), in help order."""
    from peagle_trt import demo
    from peagle_trt.bench import cli as bench_cli
    from peagle_trt.checkpoint import cli as inspect_cli
    from peagle_trt.convert import cli as convert_cli
    from peagle_trt.dynamo import cli as dynamo_cli
    from peagle_trt.engine import cli as engine_cli
    from peagle_trt.quantize import cli as quantize_cli
    from peagle_trt.train import cli as train_cli

    parser = argparse.ArgumentParser(prog="peagle-trt", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in (add_generate_parser, add_build_parser, convert_cli.add_parser, add_export_parser,
                       engine_cli.add_parser,
                       inspect_cli.add_parser, quantize_cli.add_parser, train_cli.add_parser, demo.add_parser,
                       add_serve_parser, dynamo_cli.add_parser, add_make_tiny_parser, bench_cli.add_parser):
        add_parser(sub)
    return parser


def quiet_third_party_progress(verbose: bool) -> None:
    """transformers / huggingface_hub progress bars ("Loading weights", "Writing model shards") only
    with --verbose; our own long stages keep their progress. The environment variable also reaches
    child processes (the Triton model loading its checkpoints)."""
    if verbose:
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "transformers" in sys.modules:  # already imported: its progress flag was read at import
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    quiet_third_party_progress(args.verbose)
    try:
        result = args.func(args)
    except PeagleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        print(json.dumps({"error": str(exc), "error_type": type(exc).__name__}))
        return 2
    except KeyboardInterrupt:
        print(json.dumps({"error": "interrupted"}))
        return 130
    except Exception as exc:  # the one broad catch: report, never hide
        traceback.print_exc()
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}", "error_type": "internal"}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
