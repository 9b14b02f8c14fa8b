"""vLLM's serve command taken as it is: `peagle-trt serve MODEL --speculative-config '<vLLM JSON>'`
with the flags vLLM's users type, building the pair into a cache keyed by what was asked.

    CUDA_VISIBLE_DEVICES=0 peagle-trt serve openai/gpt-oss-120b \\
        --speculative-config '{"method": "eagle3", "model": "amazon/gpt-oss-120b-p-eagle",
                               "num_speculative_tokens": 5, "parallel_drafting": true}' \\
        --max-model-len 32768 --max-num-seqs 128 --no-enable-prefix-caching --port 8040 ...

Why: a vLLM user has that line (the published heads' model cards print it); here it builds and
serves in one step, with the same words. What each vLLM flag does here (`VLLM_FLAGS`, listed in
docs/SERVING.md, "vLLM's serve command"):

* honoured: MODEL / --model (a hub id or directory, peagle_trt/hub.py), --revision, the
  speculative config (its "model" is the drafter, "revision" its revision), --max-model-len,
  --max-num-seqs, --enable-prefix-caching / --no-enable-prefix-caching, --dtype, --enforce-eager
  (no CUDA graphs), --kv-cache-dtype auto / fp8 / fp8_e4m3 (fp8: E4M3 KV caches for the target and
  the drafter, build's --kv-cache-dtype fp8, scaled by the checkpoint's calibrated k_scale / v_scale,
  else 1.0 as vLLM), --seed, --port (the OpenAI API), --host, --served-model-name, and
  -tp / --tensor-parallel-size 1 (one device; more is refused);
* accepted without effect, said on stderr and in the ready line, each with why (`NO_EFFECT`):
  scheduling and memory knobs that cannot change the output (--async-scheduling,
  --max-num-batched-tokens, --stream-interval, --max-cudagraph-capture-size,
  --gpu-memory-utilization);
* refused by name: --trust-remote-code, any other --kv-cache-dtype (`KV_CACHE_DTYPES`), and every
  flag serve does not know (`refuse_unknown`, through peagle_trt/cli.py).

`prepare(args)` resolves the models, checks a published head's pairing before any fetch, and
builds the repository with `peagle-trt build` in a child process (build sits above serve in the
floors, docs/ARCHITECTURE.md) into $PEAGLE_TRT_CACHE/repos/<model>-<key>, the key a hash of what
was asked (the models as resolved, their files, the build's flags, the package version): a second
`serve` of the same request reuses it (`--rebuild` forces a new one). Tested by
tests/serve/test_vllm_serve.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from peagle_trt.errors import BuildError, ConfigError

VLLM_PORT = 8000  # vLLM's default API port
# vLLM flags accepted without effect here: dest -> why (each named on stderr and in the ready line)
NO_EFFECT = {
    "async_scheduling": "--async-scheduling: the scheduler steps on its own thread already; the output is "
                        "the same either way",
    "max_num_batched_tokens": "--max-num-batched-tokens: prompts are prefilled in chunks of build's "
                              "--prefill-chunk tokens per request; chunking does not change the output",
    "stream_interval": "--stream-interval: tokens stream as they are produced (queued ones merged into one "
                       "chunk); the text is the same",
    "max_cudagraph_capture_size": "--max-cudagraph-capture-size: CUDA graphs (torch backend on a GPU) cover "
                                  "every batch bucket up to --max-num-seqs",
    "gpu_memory_utilization": "--gpu-memory-utilization: the KV cache holds --max-num-seqs requests of "
                              "--max-model-len tokens (build --kv-blocks to size it); preemption, if any, "
                              "recomputes exactly",
}
# vLLM's --kv-cache-dtype values taken here -> build's --kv-cache-dtype (fp8 is E4M3 on NVIDIA GPUs in vLLM)
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"}
# flags that only mean something when serve builds (MODEL), not for a built repository
BUILD_FLAGS = {"max_model_len": "--max-model-len", "max_num_seqs": "--max-num-seqs",
               "enable_prefix_caching": "--enable-prefix-caching", "dtype": "--dtype",
               "enforce_eager": "--enforce-eager", "revision": "--revision", "kv_cache_dtype": "--kv-cache-dtype",
               "backend": "--backend", "device": "--device", "rebuild": "--rebuild"}
DTYPES = {"auto": None, "float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "half": "float16"}


def human_int(text: str) -> int:
    """vLLM's integer spellings: 32768, 32k (x1000), 32K (x1024)."""
    match = re.fullmatch(r"(\d+)([kKmM]?)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"expected an integer such as 32768, 32k or 32K, got {text!r}")
    scale = {"": 1, "k": 10**3, "K": 2**10, "m": 10**6, "M": 2**20}[match[2]]
    return int(match[1]) * scale


def add_vllm_flags(s: argparse.ArgumentParser) -> None:
    """vLLM's serve flags on `peagle-trt serve` (their dests default to None: "not given")."""
    g = s.add_argument_group("vLLM's serve flags (MODEL: build into the cache, then serve)")
    g.add_argument("--model", dest="model_option", default=None, help="the model, as vLLM's --model (or MODEL)")
    g.add_argument("--revision", default=None, help="the target's hub revision (branch, tag or commit)")
    g.add_argument("--port", type=int, default=None,
                   help=f"the OpenAI API's port (default {VLLM_PORT} for MODEL; with REPO the same as --openai-port)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model's name(s) on the OpenAI API (default: MODEL as given)")
    g.add_argument("--max-model-len", type=human_int, default=None,
                   help="prompt + output tokens (build's --max-seq-len)")
    g.add_argument("--max-num-seqs", type=human_int, default=None,
                   help="most requests per step (build's --max-batch)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of cached prompt prefixes (default on)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="weight dtype (auto: float32 on CPU)")
    g.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs (torch backend)")
    g.add_argument("--kv-cache-dtype", default=None,
                   help="auto (the model dtype) | fp8 / fp8_e4m3 (E4M3 KV caches, checkpoint scales else 1.0)")
    g.add_argument("-tp", "--tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int, default=None,
                   help="1: one device (more is refused)")
    g.add_argument("--seed", type=int, default=None,
                   help="requests without a seed get one from this and their arrival order")
    g.add_argument("--trust-remote-code", action="store_true", default=None, help="refused: no repository code runs")
    for dest in NO_EFFECT:
        flag = "--" + dest.replace("_", "-")
        if dest == "async_scheduling":
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help="accepted, no effect")
        else:
            g.add_argument(flag, type=float if dest == "gpu_memory_utilization" else human_int, default=None,
                           help="accepted, no effect (docs/SERVING.md)")
    g.add_argument("--backend", default=None, choices=["auto", "tensorrt", "onnxruntime", "torch"],
                   help="MODEL: the build's executor (default auto: tensorrt where installed, else onnxruntime)")
    g.add_argument("--device", default=None, help="MODEL: the build's torch device (default cpu)")
    g.add_argument("--rebuild", action="store_true", default=None, help="MODEL: build again even when cached")


def refuse_unknown(unknown: list[str]) -> None:
    """ConfigError naming the flags `serve` does not take (vLLM's or anyone's), never ignored."""
    flags = [a for a in unknown if a.startswith("-")] or unknown
    raise ConfigError(f"peagle-trt serve does not take {', '.join(flags)} (given: {' '.join(unknown)}); "
                      "refused rather than ignored. vLLM's flags it takes are listed in docs/SERVING.md, "
                      "\"vLLM's serve command\" (peagle-trt serve --help)")


def notes(args: argparse.Namespace) -> list[str]:
    """Why each accepted-without-effect flag given has none (said on stderr and in the ready line)."""
    return [why for dest, why in NO_EFFECT.items() if getattr(args, dest, None) is not None]


def check_flags(args: argparse.Namespace, model_mode: bool) -> None:
    """Refusals that need no model: tensor parallelism, remote code, KV dtypes, REPO + build flags."""
    if args.trust_remote_code:
        raise ConfigError("--trust-remote-code is refused: peagle-trt never runs code from a model repository "
                          "(it reads config.json, tokenizer files and safetensors weights)")
    if args.tensor_parallel_size not in (None, 1):
        raise ConfigError(f"--tensor-parallel-size {args.tensor_parallel_size}: one device serves a model here; "
                          "use 1, or scale out with several replicas (docs/DEPLOY.md: Dynamo)")
    kv = args.kv_cache_dtype
    if kv is not None and kv not in KV_CACHE_DTYPES:
        why = ("only E4M3 FP8 caches are implemented here" if kv.startswith("fp8") else
               "the KV cache stores the model dtype (--dtype) or FP8")
        raise ConfigError(f"--kv-cache-dtype {kv}: {why}; use one of {', '.join(KV_CACHE_DTYPES)}")
    if not model_mode:
        given = [flag for dest, flag in BUILD_FLAGS.items() if getattr(args, dest, None) is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} set how `serve MODEL` builds; {args.repo} is a built repository: "
                              "rebuild it with `peagle-trt build` (--max-seq-len, --max-batch, ...) or serve the "
                              "model by its hub id or directory")


def is_repository(path: Path) -> bool:
    """A built Triton repository (a model folder with config.pbtxt), not a model directory."""
    return path.is_dir() and any(path.glob("*/config.pbtxt"))


@dataclass(frozen=True)
class Prepared:
    repo: Path  # the built repository in the cache
    built: bool  # False: reused
    build_s: float
    served_names: tuple[str, ...]
    target: str
    drafter: str | None
    notes: tuple[str, ...] = field(default=())


def prepare(args: argparse.Namespace, model: str) -> Prepared:
    """Resolve MODEL and the speculative config's drafter, then build them into the cache (or reuse)."""
    from peagle_trt import hub, published, speculative_config
    from peagle_trt.flags import model_type

    parsed = speculative_config.resolve(args.speculative_config, "serve")
    drafter_asked = parsed.model if parsed is not None else None
    if parsed is not None and parsed.spec.mode != "none" and drafter_asked is None:
        raise ConfigError("the speculative config names no \"model\" (the drafter); serving a model with "
                          "speculation needs one, e.g. \"model\": \"amazon/gpt-oss-120b-p-eagle\"")
    if parsed is not None and parsed.spec.synthetic_rates and not args.allow_synthetic_acceptance:
        raise ConfigError("rejection_sample_method 'synthetic' accepts drafts whatever their tokens: the output "
                          "is NOT the target's; pass --allow-synthetic-acceptance to force it (benchmarks only)")
    head_ref, target_ref = hub.parse_id(drafter_asked), hub.parse_id(model)
    head = published.published_head(head_ref.repo_id) if head_ref else None
    if head is not None and target_ref is not None:  # before anything is fetched
        published.check_pairing(head, target_ref.repo_id, None)
    target = hub.resolve(model, revision=args.revision, what="MODEL")
    if not target.is_dir():
        raise ConfigError(f"{model}: not a built repository, a model directory or a hub id (org/name); pass one of "
                          "them (`peagle-trt build` writes repositories)")
    if head is not None and target_ref is None:
        published.check_pairing(head, None, model_type(target))
    drafter = (hub.resolve(drafter_asked, revision=parsed.revision, what='the speculative config\'s "model"')
               if drafter_asked else None)
    build_argv = _build_argv(args, parsed)
    key = _key(model, args.revision, drafter_asked, parsed.revision if parsed else None, target, drafter, build_argv)
    from peagle_trt.convert.packaged import cache_root

    repos = cache_root() / "repos"
    repo = repos / f"{_slug(model)}-{key[:16]}"
    names = tuple(args.served_model_name or [model])
    if is_repository(repo) and not args.rebuild:
        return Prepared(repo, False, 0.0, names, str(target), str(drafter) if drafter else None, tuple(notes(args)))
    t0 = time.perf_counter()
    _build(["--target", str(target), *(["--drafter", str(drafter)] if drafter else []), "--output", str(repo),
            *build_argv, *(["--force"] if repo.exists() else [])])
    repos.joinpath(f"{repo.name}.json").write_text(json.dumps(
        {"model": model, "revision": args.revision, "speculative_config": args.speculative_config,
         "target": str(target), "drafter": str(drafter) if drafter else None, "build": build_argv}, indent=1) + "\n")
    return Prepared(repo, True, round(time.perf_counter() - t0, 2), names, str(target),
                    str(drafter) if drafter else None, tuple(notes(args)))


def _build_argv(args: argparse.Namespace, parsed) -> list[str]:
    """`peagle-trt build` flags of what was asked (the models aside)."""
    from peagle_trt import speculative_config

    argv = ["--backend", args.backend or "auto", "--device", args.device or "cpu"]
    if parsed is not None and parsed.spec.mode != "none":
        argv += ["--speculative-config", json.dumps(speculative_config.to_vllm(parsed.spec), sort_keys=True)]
        if parsed.spec.synthetic_rates:
            argv.append("--allow-synthetic-acceptance")
    else:
        argv += ["--spec-mode", "none"]
    if args.max_model_len is not None:
        argv += ["--max-seq-len", str(args.max_model_len)]
    if args.max_num_seqs is not None:
        argv += ["--max-batch", str(args.max_num_seqs)]
    if args.enable_prefix_caching is False:
        argv.append("--no-prefix-caching")
    if DTYPES.get(args.dtype or "auto"):
        argv += ["--dtype", DTYPES[args.dtype]]
    if args.enforce_eager:
        argv.append("--no-cuda-graphs")
    if KV_CACHE_DTYPES.get(args.kv_cache_dtype or "auto") == "fp8":
        argv += ["--kv-cache-dtype", "fp8"]
    return argv


def _fingerprint(path: Path | None) -> list:
    """(name, size, mtime) of a model directory's files: a changed checkpoint is a new request."""
    if path is None:
        return []
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(path).iterdir() if p.is_file())


def _key(model: str, revision, drafter_asked, drafter_revision, target: Path, drafter: Path | None,
         build_argv: list[str]) -> str:
    from peagle_trt import __version__

    asked = {"model": model, "revision": revision, "drafter": drafter_asked, "drafter_revision": drafter_revision,
             "target_dir": str(Path(target).resolve()),
             "drafter_dir": str(Path(drafter).resolve()) if drafter else None,
             "target_files": _fingerprint(target), "drafter_files": _fingerprint(drafter), "build": build_argv,
             "peagle_trt": __version__}
    return hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()


def _slug(model: str) -> str:
    name = model.rstrip("/").replace("/", "--").replace("@", "--")
    return re.sub(r"[^\w.-]", "_", name)[-60:] or "model"


def _build(argv: list[str]) -> None:
    """`peagle-trt build ARGV` in a child process (its progress on our stderr); BuildError with its
    message when it fails (the build is atomic: nothing is left in the cache)."""
    print(f"[serve] building: peagle-trt build {' '.join(argv)}", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, "-m", "peagle_trt.cli", "build", *argv], stdout=subprocess.PIPE,
                          text=True, env=dict(os.environ))
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "{}"
    try:
        result = json.loads(last)
    except ValueError:
        result = {"error": last}
    if proc.returncode != 0:  # the child's error, as its type when it is one of ours
        from peagle_trt import errors

        kind = getattr(errors, str(result.get("error_type")), None)
        kind = kind if isinstance(kind, type) and issubclass(kind, errors.PeagleError) else BuildError
        raise kind(f"building the repository failed: {result.get('error', 'see the messages above')}")
