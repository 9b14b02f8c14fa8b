"""`peagle-trt generate`: one request, streamed to stdout, in-process from checkpoints (`--target`)
or from a built repository (`--repo`), or through a running server (`--url`, gRPC); the same JSON
last line for all three. Models may be hub ids (peagle_trt/hub.py). The text generator it drives is
peagle_trt/serve/generator.py; tested by tests/e2e/test_cli.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from peagle_trt.config import SamplingParams
from peagle_trt.errors import ConfigError
from peagle_trt.flags import DETERMINISTIC_HELP, add_kv_dtype_flag, add_spec_flags, fill_target, resolve_spec


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
    if args.url is None and args.repo is None:
        fill_target(args)  # a published head as --drafter names its target
    sources = [x for x in (args.target, args.url, args.repo) if x is not None]
    if len(sources) != 1:
        raise ConfigError("pass exactly one of --target DIR (in-process from checkpoints), "
                          "--repo REPO (in-process from a built repository) or --url HOST:PORT (gRPC)")
    if (args.url or args.repo) and args.kv_cache_dtype != "auto":
        raise ConfigError(f"--kv-cache-dtype {args.kv_cache_dtype} applies to --target (in-process from "
                          "checkpoints); a repository's KV cache dtype is its build's: `peagle-trt build "
                          "--kv-cache-dtype`")
    if args.url and args.deterministic:
        raise ConfigError("--deterministic is the server's setting: start it with `peagle-trt serve --deterministic` "
                          "(or build the repository with --deterministic); --url only sends the request")
    params, chat_template = _sampling(args), not args.no_chat_template
    t0 = time.perf_counter()
    generator = None if args.url else _load_generator(args)
    t1 = time.perf_counter()
    if generator is None:
        from peagle_trt.serve.client import stream_generate

        result = stream_generate(args.url, args.prompt, params, args.model, _print_piece, chat_template)
    else:
        result = generator.generate(args.prompt, params, lambda event: _print_piece(event.text), chat_template)
    t2 = time.perf_counter()
    print(flush=True)
    n = len(result["token_ids"])
    return {**result, "load_s": round(t1 - t0, 3), "generate_s": round(t2 - t1, 3),
            "tokens_per_s": round(n / (t2 - t1), 2) if t2 > t1 else None}


def _load_generator(args: argparse.Namespace):
    from peagle_trt.serve.generator import TextGenerator

    if args.repo:
        from peagle_trt.serve.options import read_options, with_deterministic

        model_dir, options, paths = read_options(args.repo, args.model)
        return TextGenerator.load(model_dir, with_deterministic(options, args.deterministic), paths)
    spec = resolve_spec(args)  # first: the config's "model" may name the drafter (args.drafter)
    backend = generate_backend(args)

    def load(name: str):
        return TextGenerator.from_checkpoints(args.target, args.drafter, spec, args.device,
                                               args.dtype, args.max_seq_len, backend=name,
                                               deterministic=args.deterministic, kv_cache_dtype=args.kv_cache_dtype)

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


def add_parser(sub) -> argparse.ArgumentParser:
    g = sub.add_parser("generate", help="generate text in-process (streams text, JSON last line)")
    g.add_argument("--target", type=Path, help="target model, in-process: a Hugging Face model directory or hub id "
                   "(org/name[@revision])")
    g.add_argument("--drafter", type=Path, help="P-EAGLE or EAGLE-3 drafter: a directory or hub id")
    g.add_argument("--repo", type=Path, help="a built model repository, run in-process")
    g.add_argument("--url", help="HOST:PORT of a running server's gRPC endpoint (streaming client)")
    g.add_argument("--model", default="peagle", help="model name in the repository (default peagle)")
    g.add_argument("--prompt", required=True, help="prompt text")
    add_spec_flags(g)
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
    add_kv_dtype_flag(g)
    g.add_argument("--backend", default="auto", choices=["auto", "torch", "onnxruntime"],
                   help="with --target: auto (default) = onnxruntime for float32 on CPU (fastest there), "
                        "else torch")
    g.set_defaults(func=cmd_generate)
    return g
