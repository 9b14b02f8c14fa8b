"""A target and its drafter heads measured with the code that serves: what the suites of
peagle_trt/bench/heads.py, peagle_trt/bench/speculation.py, peagle_trt/bench/structured.py and
peagle_trt/bench/trees.py share. A configuration (`Config`) runs in process through TextGenerator
(`measure`) or served by one tritonserver (`served`); its passes are alternated with the others'
within rounds per (workload, batch), one row per cell: acceptance pooled over requests, tok/s of the
median pass, speed-up over the first configuration, mismatches with its outputs (greedy: 0, the
gate), and with `timers` where a step's time goes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from peagle_trt.bench.harness import alternate, closed_loop, progress, reported, serve_child
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError, RuntimeInvariantError

HUMANEVAL_REQUEST = "Complete the following Python function:\n\n```python\n{prompt}```"
LONG_REQUEST = "Here is the Python module `{name}`:\n\n```python\n{source}\n```\n\nSummarize what this module does."
FORWARDS = ("target", "draft_parallel", "draft_parallel_top", "drafter")  # the executor methods `timers` times


@dataclass(frozen=True)
class Config:
    name: str  # e.g. "none", "peagle K=3", "adaptive (K<=7)"
    spec: SpecConfig
    head: Path | None  # None: the target alone

    @property
    def model(self) -> str:  # its model name in a served repository
        return "".join(c if c.isalnum() else "_" for c in self.name)


def head(args, method: str, path: Path | None) -> Path:
    """A trained head: `path`, else TARGET/drafter-METHOD (where the demo pairs keep theirs)."""
    path = path or args.target / f"drafter-{method}"
    if not path.is_dir():
        raise ConfigError(f"no {method} head at {path}: pass its directory (scripts/make_smollm2_heads.py trains them)")
    return path


# -- prompts ---------------------------------------------------------------------------------------
def prompt_sets(codec, humaneval: int, heldout: int, long: int, long_tokens: int) -> dict[str, list[str]]:
    """Chat requests: HumanEval's first `humaneval`, `heldout` held-out instructions (modules the heads
    never saw), `long` module sources of `long_tokens` tokens."""
    from peagle_trt.bench.prompts import humaneval_prompts
    from peagle_trt.train.instructions import instructions, split_of, stdlib_modules

    human = [HUMANEVAL_REQUEST.format(prompt=p["prompt"]) for p in humaneval_prompts()[:humaneval]]
    held = [r["prompt"] for r in instructions("heldout", seed=0) if r["kind"] not in ("long", "essay")]
    long_prompts = []
    for name, path in stdlib_modules():
        if split_of(name) != "heldout" or len(long_prompts) >= long:
            continue
        ids = codec.tok(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
        if len(ids) >= long_tokens:
            source = codec.tok.decode(ids[:long_tokens]).rsplit("\n", 1)[0]
            long_prompts.append(LONG_REQUEST.format(name=name, source=source))
    return {"humaneval": human, "heldout": held[:heldout], "long": long_prompts}


def code_prompts(tok, n: int, max_tokens: int) -> list[str]:
    """HumanEval's first `n` prompts as raw text for a code model: trailing whitespace dropped (token
    healing: a bare final newline forces a token the corpus never has there), cut to the longest tail
    of whole lines within `max_tokens` tokens."""
    from peagle_trt.bench.prompts import humaneval_prompts

    out = []
    for p in humaneval_prompts()[:n]:
        lines = p["prompt"].rstrip().splitlines(keepends=True)
        fits = ("".join(lines[i:]) for i in range(len(lines)))
        out.append(next((t for t in fits if len(tok(t, add_special_tokens=False)["input_ids"]) <= max_tokens),
                        lines[-1]))
    return out


# -- running requests --------------------------------------------------------------------------------
def pooled(results: list[dict], k: int) -> dict:
    """AL and per-position acceptance pooled over requests (weighted by their verify steps)."""
    steps = sum(r.get("steps", 0) for r in results)
    if not k or not steps:
        return {"acceptance_length": 1.0, "accept_rate_per_pos": [], "steps": steps}
    accepted = sum((r["acceptance_length"] - 1) * r["steps"] for r in results)
    per_pos = [sum((r["accept_rate_per_pos"] + [0.0] * k)[i] * r["steps"] for r in results) / steps
               for i in range(k)]  # a request without spec steps (adaptive K = 0 throughout) has no rates
    return {"acceptance_length": round(1 + accepted / steps, 4),
            "accept_rate_per_pos": [round(p, 4) for p in per_pos], "steps": steps}


def run_batch(gen, prompts: list[str], params: SamplingParams, conc: int,
              chat_template: bool = True) -> tuple[float, list[dict]]:
    """A closed loop of `conc` requests at a time, stepped on the calling thread; (wall s, results)."""
    from peagle_trt.serve.protocol import generate_result

    results: list[dict | None] = [None] * len(prompts)
    events: dict[int, list] = {}
    errors: list[str] = []
    todo, running, t0 = iter(range(len(prompts))), 0, time.perf_counter()

    def on_event(i: int, ev) -> None:
        nonlocal running
        events.setdefault(i, []).append(ev)
        if ev.finished:
            if ev.error is not None:
                errors.append(f"prompt {i}: {ev.error}")
            evs = events.pop(i)
            results[i] = generate_result("".join(e.text for e in evs), [t for e in evs for t in e.token_ids],
                                         ev.finish_reason, ev.stats or {})
            running -= 1

    while True:
        while running < conc and (i := next(todo, None)) is not None:
            running += 1
            gen.submit(f"bench-{i}", prompts[i], params, lambda ev, i=i: on_event(i, ev), chat_template=chat_template)
        if not running:
            break
        gen.scheduler.step()
    if errors:
        raise RuntimeInvariantError(f"a benchmark request failed: {errors[0]}")
    return time.perf_counter() - t0, results


def generator(args, c: Config, slots: int, max_seq_len: int):
    from peagle_trt.serve.generator import TextGenerator

    return TextGenerator.from_checkpoints(args.target, c.head, c.spec, max_seq_len=max_seq_len, max_batch=slots,
                                          backend=args.backend, threads=getattr(args, "threads", None))


@contextlib.contextmanager
def timing(bucket: dict, owner, names: tuple[str, ...], key: str | None = None):
    """Meanwhile, every call of the methods `names` of `owner` (an object or a class; those it has)
    adds its seconds to bucket[key or the method's name] and 1 to bucket[the name + "_calls"]."""

    def wrap(name: str, inner: Callable) -> Callable:
        def timed_call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                bucket[key or name] = bucket.get(key or name, 0.0) + time.perf_counter() - t0
                bucket[name + "_calls"] = bucket.get(name + "_calls", 0) + 1
        return timed_call

    with contextlib.ExitStack() as stack:
        for name in (n for n in names if hasattr(owner, n)):
            stack.enter_context(mock.patch.object(owner, name, wrap(name, getattr(owner, name))))
        yield


# -- alternated passes ----------------------------------------------------------------------------------
Runner = Callable[[list[str], SamplingParams, int], tuple[float, list[dict]]]


def alternated(configs: list[Config], runners: dict[str, Runner], workloads: dict[str, list[str]], batch: int,
               args, timers: dict | None = None, params: dict[str, SamplingParams] | None = None,
               around: Callable[[str], contextlib.AbstractContextManager] | None = None) -> list[dict]:
    """Per workload, every configuration's pass (`runners[name](prompts, params[workload], batch)`;
    default params: greedy, `args.max_tokens`) alternated within `args.rounds` rounds, inside
    `around(name)`; one row per configuration (see the module's docstring). `timers`: the bucket
    `timing` fills during a pass (emptied before each)."""
    rows, around = [], around or (lambda _: contextlib.nullcontext())
    for wname, prompts in workloads.items():
        wparams = (params or {}).get(wname, SamplingParams(max_tokens=args.max_tokens))
        results: dict = {}
        per_pass: dict = {c.name: [] for c in configs}

        def one(c: Config, prompts=prompts) -> Callable[[], float]:
            def go() -> float:
                if timers is not None:
                    timers.clear()
                with around(c.name):
                    wall, results[c.name] = runners[c.name](prompts, wparams, batch)
                if timers is not None:
                    per_pass[c.name].append(dict(timers, wall=wall))
                return wall
            return go

        walls = alternate({c.name: one(c) for c in configs}, args.rounds, warmup=0, clock=reported,
                          on_round=lambda r: progress(f"[{args.suite}] b{batch} {wname}: round {r + 1}/{args.rounds}"))
        ref = [x["token_ids"] for x in results[configs[0].name]]
        cell = []
        for c in configs:
            res, wall = results[c.name], statistics.median(walls[c.name])
            tokens = sum(len(x["token_ids"]) for x in res)
            spec = c.spec
            k = spec.num_spec_tokens
            cell.append({"workload": wname, "batch": batch, "config": c.name, "method": spec.mode, "K": k,
                         "adaptive": spec.adaptive, "synthetic_acceptance": list(spec.synthetic_rates) or None,
                         **pooled(res, k), "tokens": tokens, "wall_s_passes": [round(w, 3) for w in walls[c.name]],
                         "tokens_per_s": round(tokens / wall, 2),
                         "mismatches": None if spec.synthetic_rates else
                         sum(a != x["token_ids"] for a, x in zip(ref, res))})
            if per_pass[c.name]:
                cell[-1].update(step_cost(per_pass[c.name]))
        for r in cell:
            r["speedup"] = round(r["tokens_per_s"] / cell[0]["tokens_per_s"], 3)
        rows += cell
    return rows


def step_cost(passes: list[dict]) -> dict:
    """Medians over passes of ms per step (a target forward), split into the target's forward, the
    drafter's (one parallel pass or K sequential ones), the grammar's masks (when timed) and the rest."""
    def med(fn) -> float:
        return round(statistics.median(fn(p) / max(p.get("target_calls", 0), 1) * 1e3 for p in passes), 3)

    step, target = med(lambda p: p["wall"]), med(lambda p: p.get("target", 0.0))
    drafter = med(lambda p: sum(p.get(n, 0.0) for n in FORWARDS[1:]))
    masks = med(lambda p: p.get("masks", 0.0))
    return {"ms_per_step": step, "target_ms": target, "drafter_ms": drafter,
            **({"masks_ms": masks} if any("masks" in p for p in passes) else {}),
            "other_ms": round(step - target - drafter - masks, 3)}


def measure(args, configs: list[Config], workloads: dict[str, list[str]], batches: list[int],
            max_seq_len: int, chat_template: bool = True, timers: dict | None = None,
            params: dict[str, SamplingParams] | None = None,
            around: Callable[[str], contextlib.AbstractContextManager] | None = None) -> list[dict]:
    """In process: per batch, one generator of `batch` slots per configuration (freed after). With
    `timers` (a dict: passes run one at a time), every executor's forwards are timed into it."""
    rows = []
    for batch in batches:
        gens = {c.name: generator(args, c, batch, max_seq_len) for c in configs}
        forwards = contextlib.ExitStack()
        for g in gens.values() if timers is not None else ():
            forwards.enter_context(timing(timers, g.scheduler.decoder.ex, FORWARDS))
        warm = [(next(iter(workloads.values())), SamplingParams())] + [(workloads[w], s)
                                                                        for w, s in (params or {}).items()]
        for gen in gens.values():  # warm-up: sessions, allocations (and a workload's own params: its grammar)
            for prompts, s in warm:
                run_batch(gen, prompts[:1], dataclasses.replace(s, max_tokens=4), 1, chat_template)
        runners = {n: (lambda p, s, b, g=g: run_batch(g, p, s, b, chat_template)) for n, g in gens.items()}
        with forwards:
            rows += alternated(configs, runners, workloads, batch, args, timers, params, around)
        gens.clear()
        gc.collect()
    return rows


def build_all(root: Path, target: Path, configs: list[Config], **options) -> None:
    """One repository at `root` holding one model per configuration, each built with
    RepositoryOptions(spec, **options)."""
    from peagle_trt.build import RepositoryOptions, build_repository

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for c in configs:
        side = root.parent / f".{root.name}-{c.model}"
        with contextlib.redirect_stdout(sys.stderr):
            build_repository(target, c.head, side, RepositoryOptions(c.spec, model_name=c.model, **options), force=True)
        shutil.move(str(side / c.model), str(root / c.model))
        shutil.rmtree(side)


def served(args, configs: list[Config], prompts: list[str], max_seq_len: int, chat_template: bool = True) -> list[dict]:
    """Every configuration a model of ONE repository served by `peagle-trt serve` (one server per model
    once deadlocked tritonserver: stubs waiting on a futex, 2026-11-23), batch-1 passes over gRPC alternated."""
    from peagle_trt.serve.client import stream_generate

    root = args.workdir / "repo"
    build_all(root, args.target, configs, backend=args.backend, max_batch=1, max_seq_len=max_seq_len)
    with serve_child(root, args.workdir, ready_timeout_s=600) as ready:
        def runner(model: str) -> Runner:
            def go(ps: list[str], params: SamplingParams, conc: int) -> tuple[float, list[dict]]:
                out: list = [None] * len(ps)

                def one(i: int, _) -> None:
                    out[i] = stream_generate(ready["grpc"], ps[i], params, model, chat_template=chat_template)
                return closed_loop(len(ps), conc, one), out
            return go

        runners = {c.name: runner(c.model) for c in configs}
        for go in runners.values():  # warm-up
            go(prompts[:1], SamplingParams(max_tokens=8), 1)
        return alternated(configs, runners, {"served": prompts}, 1, args)
