"""`peagle-trt serve`: the parser and handler of the verb, until Ctrl-C:

    peagle-trt serve REPO [--openai-port 9000]            # a repository `peagle-trt build` wrote
    peagle-trt serve MODEL --speculative-config '<vLLM JSON>' [vLLM's flags]   # vLLM's command

REPO is served by tritonserver (peagle_trt/serve/server.py), with the OpenAI frontend on
`--openai-port` (or vLLM's `--port`). MODEL (a hub id or a model directory, anything that is not a
built repository) is built first into a cache keyed by what was asked, reused by the next run of
the same request, then served with the OpenAI API on `--port` (default 8000) and Triton's ports on
the three after it unless given (peagle_trt/serve/vllm.py says which vLLM flag does what). Tested
by tests/serve/test_serve_cli.py and tests/serve/test_vllm_serve.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from peagle_trt.errors import ConfigError
from peagle_trt.flags import DETERMINISTIC_HELP
from peagle_trt.serve import vllm


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

    if (args.repo is None) == (args.model_option is None):
        raise ConfigError("pass a built repository or a model (hub id or directory): `peagle-trt serve REPO` or "
                          "`peagle-trt serve MODEL --speculative-config ...` (vLLM's --model MODEL works too), once")
    asked = args.repo if args.repo is not None else Path(args.model_option)
    model_mode = not vllm.is_repository(asked)
    vllm.check_flags(args, model_mode)
    if args.port is not None and args.openai_port is not None and args.port != args.openai_port:
        raise ConfigError(f"--port {args.port} and --openai-port {args.openai_port} both name the OpenAI API's port; "
                          "pass one")
    for note in vllm.notes(args):
        print(f"[serve] {note}", file=sys.stderr, flush=True)
    openai_port = args.port or args.openai_port
    prepared = None
    if model_mode:
        prepared = vllm.prepare(args, str(args.model_option or args.repo))
        repo, spec_json, openai_port = prepared.repo, None, openai_port or vllm.VLLM_PORT
        aliases = tuple((name, "peagle") for name in prepared.served_names)
        default_ports = (openai_port + 1, openai_port + 2, openai_port + 3)  # clear of the OpenAI port
    else:
        repo, spec_json, default_ports = args.repo, _serve_spec(args), (8000, 8001, 8002)
        aliases = _repo_aliases(repo, args.served_model_name)
    if args.deterministic:  # refused before anything starts where a model's backend cannot be (tensorrt)
        from peagle_trt.serve.options import read_options, with_deterministic

        for config in sorted(Path(repo).glob("*/config.pbtxt")):
            with_deterministic(read_options(repo, config.parent.name)[1], True)
    http, grpc, metrics = (given if given is not None else default for given, default in
                           zip((args.http_port, args.grpc_port, args.metrics_port), default_ports))
    options = ServeOptions(repo, args.host, http, grpc, metrics, args.ready_timeout,
                           drain_timeout_s=args.drain_timeout, speculative_config=spec_json,
                           deterministic=args.deterministic, log_path=args.log, seed=args.seed)

    frontend = None
    if openai_port:  # bound before tritonserver starts; answers 503 until the model is ready
        from peagle_trt.serve.openai_frontend import FrontendOptions, OpenAIFrontend

        grpc_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host  # reach Triton locally
        frontend = OpenAIFrontend(FrontendOptions(repo, f"{grpc_host}:{grpc}", args.host, openai_port,
                                                  spec_metrics=args.per_request_spec_decode_metrics,
                                                  served_names=aliases)).start()
    built = ({"repository": str(repo), "built": prepared.built, "build_s": prepared.build_s,
              "target": prepared.target, "drafter": prepared.drafter,
              "served_model_names": list(prepared.served_names), "notes": list(prepared.notes)}
             if prepared is not None else {})

    def on_ready(server):
        print(json.dumps({"ready": True, "http": server.http_url, "grpc": server.grpc_url,
                          "metrics": f"http://{args.host}:{metrics}/metrics",
                          "openai": frontend.url if frontend else None,
                          "log": str(server.log_path), **built}), flush=True)
        print("serving; Ctrl-C to stop", file=sys.stderr, flush=True)

    try:
        return {"stopped": True, **serve_forever(options, on_ready), **built}
    finally:
        if frontend is not None:
            frontend.stop()


def _repo_aliases(repo: Path, names: list[str] | None) -> tuple[tuple[str, str], ...]:
    """--served-model-name for a built repository: names for its one model."""
    if not names:
        return ()
    models = sorted(c.parent.name for c in Path(repo).glob("*/config.pbtxt"))
    if len(models) != 1:
        raise ConfigError(f"--served-model-name names one model, and {repo} holds {len(models)} ({', '.join(models)}); "
                          "request them by their own names")
    return tuple((name, models[0]) for name in names)


def add_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="serve a built repository, or a model (hub id or directory) as vLLM's serve "
                                     "command does, with tritonserver until Ctrl-C")
    s.add_argument("repo", type=Path, nargs="?", default=None, metavar="REPO_OR_MODEL",
                   help="a repository built by `peagle-trt build`, or a model: hub id (org/name[@revision]) or "
                        "model directory, built first into a cache ($PEAGLE_TRT_CACHE/repos) with the speculative "
                        "config's drafter")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    s.add_argument("--http-port", type=int, default=None, help="Triton's HTTP port (default 8000; MODEL: --port + 1)")
    s.add_argument("--grpc-port", type=int, default=None, help="Triton's gRPC port (default 8001; MODEL: --port + 2)")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="Triton's metrics port (default 8002; MODEL: --port + 3)")
    s.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for readiness")
    s.add_argument("--log", type=Path, default=None,
                   help="tritonserver's log (default: a temporary file, removed after a clean stop, kept "
                        "and named after a failure)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM / Ctrl-C, seconds running streams may take to finish (default 30); "
                        "a second signal stops at once")
    s.add_argument("--openai-port", type=int, default=None,
                   help="also serve OpenAI-compatible /v1/... on this port (same --host); REPO: off by default")
    s.add_argument("--per-request-spec-decode-metrics", choices=("none", "summary", "detailed"), default="summary",
                   help="vLLM's per-response metrics.speculative_decoding on the OpenAI API (default summary; "
                        "detailed adds per-step lists)")
    s.add_argument("--deterministic", action="store_true",
                   help=DETERMINISTIC_HELP + "; every model of the repository (sets VLLM_BATCH_INVARIANT=1 for them)")
    s.add_argument("--speculative-config", default=None,
                   help="vLLM's JSON (default: $SM_VLLM_SPECULATIVE_CONFIG). MODEL: the whole config, its \"model\" "
                        "the drafter (hub id or directory). REPO: run-time keys over the built config "
                        "(num_speculative_tokens_per_batch_size, adaptive_num_speculative_tokens, synthetic "
                        "acceptance); method and K must be the built ones")
    s.add_argument("--allow-synthetic-acceptance", action="store_true",
                   help="accept a synthetic rejection_sample_method (benchmarks only: output is not the target's)")
    vllm.add_vllm_flags(s)
    s.set_defaults(func=cmd_serve, refuse_unknown=vllm.refuse_unknown)
    return s
