"""`peagle-trt demo`: the main job on a machine without GPU/TensorRT, with the project's trained pair.

    peagle-trt demo [--prompt CODE] [--max-tokens 128] [--num-spec-tokens 7]

Builds one Triton model repository holding two models of the code pair shipped in
peagle_trt/assets/code-pair/ (made by scripts/make_code_pair.py: a small Llama trained on the
Python standard library and its P-EAGLE head): `peagle` (speculative, one drafter pass per
step) and `target` (the same target, no drafter). Serves it with a real `tritonserver`
(loopback), streams the P-EAGLE answer to the terminal, runs the same greedy request on
`target`, and reports the acceptance length, both output rates and the speed-up, measured in
this run (after one short warm-up request per model). Greedy outputs must be identical.
Tested by tests/e2e/test_trained_pair.py (test_demo_streams_code_and_measures_the_speedup, marked
triton).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
import time
from importlib import resources
from pathlib import Path

from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError

DEFAULT_PROMPT = 'def is_empty(self):\n    """Return True if the queue is empty."""'


def default_pair() -> Path:
    """The trained code pair installed with the package (peagle_trt/assets/code-pair/)."""
    return Path(str(resources.files("peagle_trt.assets") / "code-pair"))


def add_parser(sub) -> argparse.ArgumentParser:
    d = sub.add_parser("demo", help="the main job on CPU: the trained code pair served by tritonserver")
    d.add_argument("--pair", type=Path, default=None,
                   help="target dir holding drafter-peagle/ (default: the trained code pair shipped in the package)")
    d.add_argument("--workdir", type=Path, default=Path("artifacts/demo"), help="where to write the repository")
    d.add_argument("--prompt", default=DEFAULT_PROMPT,
                   help="code to continue (trailing whitespace is dropped: the tokenizer merges a newline "
                        "with the next line's indentation, so the first token should carry both)")
    d.add_argument("--num-spec-tokens", type=int, default=7, help="K (default 7)")
    d.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    d.add_argument("--backend", default="torch", choices=["torch", "onnxruntime"],
                   help="executor of the served models (default torch: the faster one on CPU at this size)")
    d.set_defaults(func=cmd_demo)
    return d


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _note(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def build_demo_repo(pair: Path, repo: Path, spec: SpecConfig, backend: str) -> None:
    """One repository with two models: `peagle` (target + P-EAGLE head) and `target` (no drafter)."""
    from peagle_trt.repository import RepositoryOptions, build_repository

    side = repo.parent / f".{repo.name}-target"
    build_repository(pair, pair / "drafter-peagle", repo,
                     RepositoryOptions(spec, backend=backend, max_batch=2, max_seq_len=1024), force=True)
    build_repository(pair, None, side, RepositoryOptions(SpecConfig("none", 0), model_name="target", backend=backend,
                                                max_batch=2, max_seq_len=1024), force=True)
    shutil.move(str(side / "target"), str(repo / "target"))
    shutil.rmtree(side)


def cmd_demo(args: argparse.Namespace) -> dict:
    from peagle_trt.serving.client import stream_generate
    from peagle_trt.serving.server import ServeOptions, TritonServer

    t0 = time.perf_counter()
    pair = args.pair or default_pair()
    if not (pair / "config.json").is_file() or not (pair / "drafter-peagle" / "config.json").is_file():
        raise ConfigError(f"the trained code pair is not at {pair}: run from a source checkout "
                          "(pip install -e .), pass --pair DIR, or make it with "
                          "scripts/make_code_pair.py DIR")
    spec = SpecConfig("peagle", args.num_spec_tokens)
    prompt = args.prompt.rstrip()
    repo = args.workdir / "repo"
    build_demo_repo(pair, repo, spec, args.backend)
    _note(f"built {repo}: models 'peagle' (P-EAGLE K={spec.num_spec_tokens}) and 'target' (no drafter), "
          f"backend {args.backend}")
    serve = ServeOptions(repo, "127.0.0.1", _free_port(), _free_port(), _free_port())
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    with TritonServer(serve) as server:
        url = server.grpc_url
        _note(f"tritonserver ready on {url} (loopback); warming up both models ...")
        for model in ("peagle", "target"):
            stream_generate(url, prompt, SamplingParams(max_tokens=8, ignore_eos=True), model)
        _note("P-EAGLE, streamed:")
        print(prompt, end="", flush=True)
        t1 = time.perf_counter()
        spec_out = stream_generate(url, prompt, params, "peagle",
                                   on_text=lambda piece: print(piece, end="", flush=True))
        t_spec = time.perf_counter() - t1
        print(flush=True)
        _note("the same request on the target alone ...")
        t1 = time.perf_counter()
        base_out = stream_generate(url, prompt, params, "target")
        t_base = time.perf_counter() - t1
    n_spec, n_base = len(spec_out["token_ids"]), len(base_out["token_ids"])
    rate_spec, rate_base = n_spec / t_spec, n_base / t_base
    identical = spec_out["token_ids"] == base_out["token_ids"]
    _note(f"acceptance length {spec_out['acceptance_length']:.2f} (tokens per target forward, K={spec.k}); "
          f"P-EAGLE {rate_spec:.1f} tok/s vs target alone {rate_base:.1f} tok/s: "
          f"speed-up {rate_spec / rate_base:.2f}x; identical output: {'yes' if identical else 'NO'}")
    return {"text": spec_out["text"], "acceptance_length": spec_out["acceptance_length"],
            "accept_rate_per_pos": spec_out["accept_rate_per_pos"], "tokens": n_spec,
            "target_forwards": spec_out["target_forwards"], "peagle_tokens_per_s": round(rate_spec, 2),
            "target_tokens_per_s": round(rate_base, 2), "speedup": round(rate_spec / rate_base, 3),
            "identical_to_target": identical, "repository": str(repo), "backend": args.backend,
            "num_spec_tokens": spec.k, "total_s": round(time.perf_counter() - t0, 2)}
