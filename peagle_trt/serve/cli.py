"""`peagle-trt serve`: the parser and handler of the verb: a built repository served by tritonserver
(peagle_trt/serve/server.py), with the OpenAI frontend on `--openai-port`, until Ctrl-C. Tested by
tests/serve/test_serve_cli.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from peagle_trt.errors import ConfigError
from peagle_trt.flags import DETERMINISTIC_HELP


def _serve_spec(args: argparse.Namespace) -> str | None:
    """The serve-time speculative config (flag, else $SM_VLLM_SPECULATIVE_CONFIG) over the built
    one of every model of the repository, checked before anything starts; its vLLM JSON for the
    Triton models, or None."""
    from peagle_trt import speculative_config
    from peagle_trt.serve.options import read_options

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
    from peagle_trt.serve.server import ServeOptions, serve_forever

    if args.deterministic:  # refused before anything starts where a model's backend cannot be (tensorrt)
        from peagle_trt.serve.options import read_options, with_deterministic

        for config in sorted(Path(args.repo).glob("*/config.pbtxt")):
            with_deterministic(read_options(args.repo, config.parent.name)[1], True)
    options = ServeOptions(args.repo, args.host, args.http_port, args.grpc_port, args.metrics_port,
                           args.ready_timeout, drain_timeout_s=args.drain_timeout,
                           speculative_config=_serve_spec(args), deterministic=args.deterministic,
                           log_path=args.log)

    frontend = None
    if args.openai_port:  # bound before tritonserver starts; answers 503 until the model is ready
        from peagle_trt.serve.openai_frontend import FrontendOptions, OpenAIFrontend

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


def add_parser(sub) -> argparse.ArgumentParser:
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
