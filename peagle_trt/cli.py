"""`peagle-trt`: the command line. Each subcommand's LAST stdout line is one JSON object.

    peagle-trt generate --target DIR --drafter DIR --prompt TEXT [--spec-mode peagle] ...
    peagle-trt demo                     # the main job on a CPU machine (the trained code pair)
    peagle-trt train --target DIR --output DIR --text-list FILES   # train a P-EAGLE / EAGLE-3 head
    peagle-trt convert --gguf FILE.gguf --output DIR   # a GGUF model -> a target directory
    peagle-trt make-tiny OUT_DIR        # small seeded checkpoints for demos and tests
    peagle-trt inspect [TARGET_DIR] DRAFTER_DIR   # what a checkpoint is; whether a pair fits
    peagle-trt bench SUITE [options]    # a benchmark suite (peagle-trt bench --help lists them)
    peagle-trt dynamo worker|frontend   # serve behind NVIDIA Dynamo (many machines, KV-aware routing)

Each verb is the folder of its name (peagle_trt/<verb>/, `make-tiny` in peagle_trt/make_tiny/), whose
cli.py holds its parser and handler (`add_parser(sub)`); this module only registers them and runs the
one chosen. It is the only module that catches broad exceptions: it prints them and exits non-zero.
Arguments no parser knows are refused by argparse, or, for a verb that sets `refuse_unknown` (serve:
vLLM's flags), by that function's ConfigError naming them (JSON last line). A leading typographic
dash (`—tp`) is read as `--` (peagle_trt/flags.py, `normalize_argv`).
Tested by tests/e2e/test_cli.py and tests/test_layout.py (verb = folder).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback

from peagle_trt.errors import PeagleError


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand is wired the same way: the `add_parser(sub)` of its folder's cli.py (verb =
    folder, `make-tiny` in make_tiny/; tests/test_layout.py checks it), in help order."""
    from peagle_trt.bench import cli as bench_cli
    from peagle_trt.build import cli as build_cli
    from peagle_trt.convert import cli as convert_cli
    from peagle_trt.demo import cli as demo_cli
    from peagle_trt.dynamo import cli as dynamo_cli
    from peagle_trt.engine import cli as engine_cli
    from peagle_trt.export import cli as export_cli
    from peagle_trt.generate import cli as generate_cli
    from peagle_trt.inspect import cli as inspect_cli
    from peagle_trt.make_tiny import cli as make_tiny_cli
    from peagle_trt.quantize import cli as quantize_cli
    from peagle_trt.serve import cli as serve_cli
    from peagle_trt.train import cli as train_cli

    parser = argparse.ArgumentParser(prog="peagle-trt", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for verb in (generate_cli, build_cli, convert_cli, export_cli, engine_cli, inspect_cli, quantize_cli, train_cli,
                 demo_cli, serve_cli, dynamo_cli, make_tiny_cli, bench_cli):
        verb.add_parser(sub)
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
    from peagle_trt.flags import normalize_argv

    parser = build_parser()
    args, unknown = parser.parse_known_args(normalize_argv(sys.argv[1:] if argv is None else list(argv), parser))
    refuse_unknown = getattr(args, "refuse_unknown", None)  # a verb that names what it does not take
    if unknown and refuse_unknown is None:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    quiet_third_party_progress(args.verbose)
    try:
        if unknown:
            refuse_unknown(unknown)  # raises a ConfigError naming them
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
