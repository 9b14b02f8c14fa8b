"""`peagle-trt dynamo`: the subcommand's parsers and handlers (wired into peagle_trt/cli.py).

    peagle-trt dynamo worker --repo REPO [--model peagle] --host ADDR --discovery-dir DIR
    peagle-trt dynamo frontend --host ADDR --http-port 8000 --discovery-dir DIR [--router-mode kv]

Both run until SIGTERM / SIGINT and need Dynamo: run them with the interpreter of .venv-dynamo
(scripts/dynamo_env.sh), e.g. `.venv-dynamo/bin/python -m peagle_trt.cli dynamo worker ...`.
Every plane binds --host (default 127.0.0.1); see peagle_trt/dynamo/options.py.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from peagle_trt.dynamo.options import Planes, WorkerOptions, check_wildcard_reach
from peagle_trt.dynamo.worker import ROUTER_MODES, FrontendOptions, frontend_command, require_dynamo, run_worker


def _planes(args: argparse.Namespace) -> Planes:
    return Planes(args.host, args.discovery_backend, str(args.discovery_dir or ""), args.namespace,
                  args.allow_all_interfaces)


def cmd_worker(args: argparse.Namespace) -> dict:
    options = WorkerOptions(args.repo, _planes(args), args.model, args.served_model_name, not args.no_kv_events,
                            args.drain_timeout, args.deterministic)
    require_dynamo()
    check_wildcard_reach(options.planes)
    run_worker(options)
    return {"worker": options.served_name, "exit": "shut down"}


def cmd_frontend(args: argparse.Namespace) -> dict:
    options = FrontendOptions(_planes(args), args.http_port, args.router_mode, migration_limit=args.migration_limit)
    argv, env = frontend_command(options)
    os.execvpe(argv[0], argv, env)  # the frontend replaces this process (signals reach it directly)
    return {}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="the one address every plane of this process binds (default: loopback)")
    p.add_argument("--allow-all-interfaces", action="store_true",
                   help="allow --host 0.0.0.0 and Dynamo's event-plane publishers on every interface")
    p.add_argument("--discovery-backend", default="file", help="file (default), etcd or kubernetes")
    p.add_argument("--discovery-dir", type=Path, default=None,
                   help="the file backend's directory, shared by the frontend and every worker")
    p.add_argument("--namespace", default="peagle", help="Dynamo namespace of the deployment")


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `dynamo` (worker | frontend) on the `peagle-trt` subparsers."""
    d = sub.add_parser("dynamo", help="serve behind NVIDIA Dynamo: a worker for a built repository, or the frontend")
    verbs = d.add_subparsers(dest="dynamo_command", required=True)
    w = verbs.add_parser("worker", help="one worker serving one model of a built repository")
    w.add_argument("--repo", required=True, type=Path, help="a repository built by `peagle-trt build`")
    w.add_argument("--model", default="peagle", help="the model's directory in the repository")
    w.add_argument("--served-model-name", default="", help="the name clients use (default: --model)")
    w.add_argument("--no-kv-events", action="store_true", help="publish no KV block events (no KV-aware routing)")
    w.add_argument("--drain-timeout", type=float, default=60.0,
                   help="on SIGTERM, seconds to let running requests finish (after Dynamo's 5 s grace)")
    w.add_argument("--deterministic", action="store_true",
                   help="row- and batch-invariant forwards: a request's output does not depend on its batch "
                        "(torch / onnxruntime backends; also VLLM_BATCH_INVARIANT=1)")
    _common(w)
    w.set_defaults(func=cmd_worker)
    f = verbs.add_parser("frontend", help="Dynamo's OpenAI frontend and router (replaces this process)")
    f.add_argument("--http-port", type=int, default=8000, help="OpenAI HTTP port (on --host)")
    f.add_argument("--router-mode", default="kv", choices=ROUTER_MODES, help="kv: KV-aware routing (default)")
    f.add_argument("--migration-limit", type=int, default=0,
                   help="0: a dead worker's streams end with an error; N: replay them on another worker (N times)")
    _common(f)
    f.set_defaults(func=cmd_frontend)
    return d
