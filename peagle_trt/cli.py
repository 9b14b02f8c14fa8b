"""`peagle-trt`: the command line. Each subcommand's LAST stdout line is one JSON object.

    peagle-trt generate --target DIR --drafter DIR --prompt TEXT [--spec-mode peagle] ...
    peagle-trt demo                     # the main job on a CPU machine (small seeded models)
    peagle-trt make-tiny OUT_DIR        # small seeded checkpoints for demos and tests

This is the only module that catches broad exceptions: it prints them and exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from pathlib import Path

from peagle_trt.config import SPEC_MODES, SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError, PeagleError


def resolve_spec(args: argparse.Namespace) -> SpecConfig:
    """Spec config from --speculative-config and/or --spec-mode / --num-spec-tokens."""
    if args.speculative_config:
        spec = SpecConfig.from_vllm(args.speculative_config)
        if args.spec_mode not in (None, spec.mode):
            raise ConfigError(f"--spec-mode {args.spec_mode} contradicts --speculative-config "
                              f"(which means {spec.mode}); pass one of them")
        if args.num_spec_tokens not in (None, spec.num_spec_tokens):
            raise ConfigError(f"--num-spec-tokens {args.num_spec_tokens} contradicts "
                              f"num_speculative_tokens={spec.num_spec_tokens} in --speculative-config")
        return spec
    mode = args.spec_mode
    if mode is None:  # default: P-EAGLE when the head has mask_hidden, else EAGLE-3, else none
        from peagle_trt.checkpoint.safetensors_io import tensor_names

        if args.drafter is None:
            mode = "none"
        else:
            names = tensor_names(Path(args.drafter))
            mode = "peagle" if {"mask_hidden", "model.mask_hidden"} & names else "eagle3"
    return SpecConfig(mode, args.num_spec_tokens or 7)


def cmd_generate(args: argparse.Namespace) -> dict:
    from peagle_trt.offline import OfflineEngine

    spec = resolve_spec(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            ignore_eos=args.ignore_eos, stop=tuple(args.stop or ()))
    t0 = time.perf_counter()
    engine = OfflineEngine.load(args.target, args.drafter, spec, args.device, args.dtype)
    t1 = time.perf_counter()
    result = engine.generate(args.prompt, params, chat_template=not args.no_chat_template,
                             on_text=lambda piece: print(piece, end="", flush=True))
    t2 = time.perf_counter()
    print(flush=True)
    n = len(result["token_ids"])
    return {**result, "load_s": round(t1 - t0, 3), "generate_s": round(t2 - t1, 3),
            "tokens_per_s": round(n / (t2 - t1), 2) if t2 > t1 else None}


def cmd_make_tiny(args: argparse.Namespace) -> dict:
    from peagle_trt.tiny import make_all

    return {k: str(v) for k, v in make_all(args.out).items()}


def cmd_demo(args: argparse.Namespace) -> dict:
    """The main job on a machine without a GPU: small seeded models, then one streamed request."""
    from peagle_trt.offline import OfflineEngine
    from peagle_trt.tiny import make_all

    paths = make_all(args.workdir)
    print(f"[demo] wrote small seeded checkpoints to {args.workdir}", file=sys.stderr)
    spec = SpecConfig("peagle", args.num_spec_tokens)
    engine = OfflineEngine.load(paths["llama"], paths["aws"], spec)
    result = engine.generate(args.prompt, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
                             on_text=lambda piece: print(piece, end="", flush=True))
    print(flush=True)
    return {**result, "workdir": str(args.workdir)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="peagle-trt", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text in-process (streams text, JSON last line)")
    g.add_argument("--target", required=True, type=Path, help="Hugging Face target model directory")
    g.add_argument("--drafter", type=Path, help="P-EAGLE or EAGLE-3 drafter directory")
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--spec-mode", choices=SPEC_MODES, default=None,
                   help="none | eagle3 (K sequential drafter passes) | peagle (one parallel pass); "
                        "default: peagle if the drafter has mask_hidden, else eagle3")
    g.add_argument("--num-spec-tokens", type=int, default=None, help="K, draft tokens per step (default 7)")
    g.add_argument("--speculative-config", default=None,
                   help='vLLM form, e.g. \'{"method":"eagle3","num_speculative_tokens":7,'
                        '"parallel_drafting":true}\'')
    g.add_argument("--max-tokens", type=int, default=128, help="maximum generated tokens (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="top-k filter, 0 = off (default)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    g.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    g.add_argument("--device", default="cpu", help="torch device (default cpu)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weight dtype (default float32)")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="the main job on CPU: small models + one streamed request")
    d.add_argument("--workdir", type=Path, default=Path("artifacts/demo"), help="where to write models")
    d.add_argument("--prompt", default="Explain speculative decoding.", help="prompt text")
    d.add_argument("--num-spec-tokens", type=int, default=7, help="K (default 7)")
    d.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    d.set_defaults(func=cmd_demo)

    t = sub.add_parser("make-tiny", help="write small seeded checkpoints (targets + drafters)")
    t.add_argument("out", type=Path, help="output directory")
    t.set_defaults(func=cmd_make_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
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
