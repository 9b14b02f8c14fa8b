"""Suite `seeds` (docs/BENCHMARKS.md, "seeds"): the P-EAGLE seeds' own targets at their real shapes, random
weights, synthetic acceptance at the published figures, beside the seeds' published B200 table.

Targets (peagle_trt/bench/seed_models.py, built layer by layer on the device): Qwen3-Coder-30B-A3B (FP8
experts), GPT-OSS-20B, GPT-OSS-120B (FP8 experts), with random P-EAGLE (4 layers) and EAGLE-3 (1 layer)
heads of the published shapes. Per target, each section alternating its contenders within rounds:
  table     none vs EAGLE-3 (K = 3) vs P-EAGLE (K = 7; and K = 11 for Qwen3-Coder) at each --concurrency:
            `steps` SpecDecoder steps per round per contender at --context cached positions,
            SyntheticAcceptor drafts (ACCEPTANCE: which figure, and how per-position rates were
            had), tok/s in all and per user, speed-up over none, P-EAGLE / EAGLE-3 (PUBLISHED beside)
  curve     the verify cost curve at batch 1: one target forward of 1 .. --curve-rows rows, its
            median ms and the distinct experts per MoE layer its router picked (top-k of each gate's
            logits, by forward hooks on an eager pass), beside the uniform-routing expectation
            E (1 - (1 - k / E)^rows). Random weights route near-uniformly: the pessimistic case
  adaptive  none, adaptive K (K <= the P-EAGLE K) and every fixed K 1 .. K (--adaptive-ks), at each
            --concurrency: tok/s; adaptive over none and over the best fixed K (per round, median)
The issue's GPU targets are checked on what was measured (`targets`). Every step's time includes
the host's (the step is synchronised once per round: a server's loop).

Flags (`peagle-trt bench seeds --help`): --targets (comma list of seed_models.SEEDS), --sections,
--concurrency, --context, --steps, --rounds, --warmup, --curve-rows, --adaptive-ks, --layers (a layer
slice of each target: labelled, not the model's speed), --experts (override the seeds' expert format),
--no-cuda-graphs, and --budget-s N: a section (a target's build, one concurrency of a table or adaptive
run, a curve) that would start after N seconds is skipped and listed, so a time-boxed GPU run stops in
time (scripts/gpu_validate.sh: `python -m peagle_trt.cli bench seeds --budget-s N --output-dir $OUT`).
OUTPUT_DIR (default $OUT, else gpu_results)/bench_seeds.json is rewritten after every section.
Needs CUDA; --smoke runs every section end to end on the CPU at SMALL widths (4 layers, seconds:
tests/bench/test_seeds.py), figures meaningless.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from peagle_trt.bench.harness import (
    Figure,
    alternate,
    finish,
    int_list,
    lines,
    median_ms,
    progress,
    records,
    reported,
    series,
)
from peagle_trt.bench.seed_models import EXPERT_FORMATS, SEEDS, build_head, build_target
from peagle_trt.config import KVLayout, SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError, RuntimeInvariantError
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.models.moe import SparseMoE
from peagle_trt.ops import kernels as cuda_kernels
from peagle_trt.speculative.decoder import Sequence, SpecDecoder
from peagle_trt.speculative.stats import SpecStats


@dataclass(frozen=True)
class Acceptance:
    """Published acceptance of one head: (K, AL) points, or unconditional per-position rates."""
    points: tuple[tuple[int, float], ...] = ()
    per_position: tuple[float, ...] = ()
    source: str = ""


PR_32628 = (0.72, 0.50, 0.33, 0.21, 0.14, 0.09, 0.06)  # EAGLE-3, K = 7, HumanEval (vLLM PR #32628)
ACCEPTANCE = {  # (seed, mode) -> what its synthetic drafts are accepted at
    ("qwen3-coder-30b-a3b", "peagle"): Acceptance(((4, 4.30), (10, 6.66), (18, 7.51)), source=(
        "HumanEval AL 4.30 / 6.66 / 7.51 at K = 4 / 10 / 18 (HF card amazon/Qwen3-Coder-30B-A3B-Instruct-P-EAGLE); "
        "no per-position rates published: piecewise geometric fit")),
    ("qwen3-coder-30b-a3b", "eagle3"): Acceptance(per_position=PR_32628, source=(
        "no Qwen3-Coder EAGLE-3 acceptance published: vLLM PR #32628's EAGLE-3 HumanEval per-position rates "
        "(a GPT-OSS head) stand in")),
    ("gpt-oss-20b", "peagle"): Acceptance(((3, 3.02), (7, 3.94)), source=(
        "HumanEval AL 3.02 / 3.94 at K = 3 / 7 (vLLM/AWS P-EAGLE blog, GPT-OSS-20B); piecewise geometric fit")),
    ("gpt-oss-20b", "eagle3"): Acceptance(((3, 2.65), (7, 3.03)), source=(
        "HumanEval AL 2.65 / 3.03 at K = 3 / 7 (same blog, RedHatAI EAGLE-3 head); piecewise geometric fit")),
    ("gpt-oss-120b", "peagle"): Acceptance(((5, 3.15),), source=(
        "HumanEval AL 3.15 at K = 5 (HF card amazon/gpt-oss-120b-p-eagle); geometric fit, extended to K = 7")),
    ("gpt-oss-120b", "eagle3"): Acceptance(per_position=PR_32628, source=(
        "vLLM PR #32628: EAGLE-3 per-position HumanEval rates, K = 7 (GPT-OSS-120B per peagle-spec.md 4.4)")),
}
MODES = {"qwen3-coder-30b-a3b": (("none", 0), ("eagle3", 3), ("peagle", 7), ("peagle", 11)),
         "gpt-oss-20b": (("none", 0), ("eagle3", 3), ("peagle", 7)),
         "gpt-oss-120b": (("none", 0), ("eagle3", 3), ("peagle", 7))}
# The seeds' published B200 figures (tok/s in all, concurrency c); derived = arithmetic on published ratios
PUBLISHED = [
    *({"target": "qwen3-coder-30b-a3b", "concurrency": 1, "mode": m, "tok_s": v, "workload": "HumanEval",
       "source": "AWS SageMaker blog via secondary summaries (FP8, K = 11 per one summary)"}
      for m, v in (("none", 294), ("eagle3", 955), ("peagle", 1167))),
    *({"target": "gpt-oss-20b", "concurrency": c, "mode": "peagle", "over_eagle3": r, "workload": "HumanEval",
       "source": "vLLM/AWS P-EAGLE blog: P-EAGLE (K = 7) over EAGLE-3 (best K)"} for c, r in ((1, 1.55), (8, 1.35),
                                                                                            (64, 1.23))),
    {"target": "gpt-oss-120b", "concurrency": 1, "mode": "peagle", "tok_s": 560, "over_eagle3": 1.12,
     "over_none": 1.52, "workload": "MT-Bench", "source": "vLLM PR #32887 (2-layer P-EAGLE, K = 7)"},
    {"target": "gpt-oss-120b", "concurrency": 8, "mode": "peagle", "tok_s": 2389, "over_eagle3": 1.07,
     "over_none": 1.34, "workload": "MT-Bench", "source": "vLLM PR #32887 (K = 3)"},
]
PRESETS = {"seeds": dict(context=1024)}
SMOKE = dict(small=True, layers=4, concurrency="2", context=16, steps=2, rounds=1, warmup=1, curve_rows=4,
             adaptive_ks="")


def fit_rates(points: tuple[tuple[int, float], ...], k: int) -> tuple[float, ...]:
    """Unconditional rates P(first i drafts accepted), i = 1..k, through published (K, AL) points: between
    consecutive Ks one conditional rate (geometric), solved so that AL(K) = 1 + the rates' sum up to K;
    past the last point its rate goes on."""
    rates, prob, alpha, done = [], 1.0, 1.0, 0
    for K, al in sorted(points):
        need, n = al - 1 - sum(rates), K - done
        if not 0 < need <= prob * n:
            raise ConfigError(f"acceptance length {al} at K = {K} does not follow the points before it: "
                              f"positions {done + 1}..{K} would need {need:.3f} of at most {prob * n:.3f}")
        lo, hi = 0.0, 1.0
        for _ in range(60):  # bisection: sum_{i=1..n} prob * alpha^i = need
            alpha = (lo + hi) / 2
            lo, hi = (alpha, hi) if prob * sum(alpha ** i for i in range(1, n + 1)) < need else (lo, alpha)
        for _ in range(n):
            prob *= alpha
            rates.append(prob)
        done = K
    while len(rates) < k:
        prob *= alpha
        rates.append(prob)
    return tuple(round(r, 6) for r in rates[:k])


def synthetic_rates(name: str, mode: str, k: int) -> tuple[float, ...]:
    """The rates the seed's `mode` head is accepted at with k drafts (ACCEPTANCE)."""
    a = ACCEPTANCE[(name, mode)]
    if not a.per_position:
        return fit_rates(a.points, k)
    rates = list(a.per_position[:k])
    while len(rates) < k:  # past the table: its last conditional rate
        rates.append(rates[-1] * a.per_position[-1] / a.per_position[-2])
    return tuple(rates)


def spec_for(name: str, mode: str, k: int, adaptive: bool = False) -> SpecConfig:
    if mode == "none":
        return SpecConfig("none", 0)
    return SpecConfig(mode, k, adaptive=adaptive, synthetic_rates=synthetic_rates(name, mode, k))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def blocks_of(kv: KVLayout, windows: tuple[int, ...], i: int) -> list[list[int]]:
    """Sequence i's block lists per KV group in a layout of kv.max_batch sequences: its own M blocks in
    group 0; in a windowed group a ring of the blocks such a group holds per request (KVLayout.window_blocks;
    aliased entries lie behind the window, which attention masks by position)."""
    m = kv.max_blocks
    out = [[i * m + j for j in range(m)]]
    for n in kv.group_blocks(windows)[1:]:
        ring = min(m, n // kv.max_batch)
        out.append([i * ring + j % ring for j in range(m)])
    return out


class Contender:
    """One configuration at one concurrency: its own decoder and sequences on a shared executor (the KV
    contents mean nothing with random weights); each call runs `steps` steps, synchronised, and returns
    their seconds (harness `reported`), recording the tokens they emitted."""

    def __init__(self, ex: TorchExecutor, spec: SpecConfig, c: int, context: int, steps: int):
        self.ex, self.steps, self.tokens = ex, steps, []
        self.decoder = SpecDecoder(ex, spec)
        self.decoder.batch = c
        params = SamplingParams(max_tokens=1 << 30, ignore_eos=True)
        k = spec.num_spec_tokens
        self.seqs = [Sequence([1] * context, params, None, output=[2], drafts=[3] * k, stats=SpecStats(k),
                              num_computed=context, cur=context, blocks=blocks_of(ex.kv, ex.windows, i))
                     for i in range(c)]

    def __call__(self) -> float:
        before = sum(len(s.output) for s in self.seqs)
        sync(self.ex.device)
        t0 = time.perf_counter()
        for _ in range(self.steps):
            self.decoder.step(self.seqs)
        sync(self.ex.device)
        seconds = time.perf_counter() - t0
        if any(s.finished for s in self.seqs):
            raise RuntimeInvariantError("a benchmark sequence reached its length: the KV layout is sized too small")
        self.tokens.append(sum(len(s.output) for s in self.seqs) - before)
        return seconds


def alternated(a, contenders: dict[str, Contender]) -> dict[str, dict]:
    """The contenders alternated over a.rounds (after a.warmup): per contender its per-round tok/s, median
    tok/s and realized acceptance length (tokens per request-step)."""
    seconds = alternate(contenders, a.rounds, a.warmup, clock=reported)
    out = {}
    for name, c in contenders.items():
        tokens = c.tokens[-a.rounds:]
        rates = [t / s for t, s in zip(tokens, seconds[name])]
        out[name] = {"per_round": rates, "tok_s": statistics.median(rates),
                     "acceptance_length": sum(tokens) / (len(tokens) * c.steps * len(c.seqs))}
    return out


def executor(a, target, head, c: int) -> TorchExecutor:
    kv = KVLayout.for_sequences(c, a.max_len, max_rows=max(a.k_max + 1, a.curve_rows))
    return TorchExecutor(target, head, kv, kernels=a.kernels, cuda_graphs=a.graphs)


def section_table(a, name: str, target, heads: dict, c: int) -> list[dict]:
    """none vs EAGLE-3 vs P-EAGLE at concurrency c (one executor per head; none on P-EAGLE's)."""
    exs = {kind: executor(a, target, head, c) for kind, head in heads.items()}
    modes = {("none" if m == "none" else f"{m} K={k}"): (m, k) for m, k in MODES[name]}
    contenders = {n: Contender(exs["peagle" if m == "none" else m], spec_for(name, m, k), c, a.context, a.steps)
                  for n, (m, k) in modes.items()}
    got, rows = alternated(a, contenders), []
    for n, (m, k) in modes.items():
        r = got[n]
        rows.append({"target": name, "mode": m, "k": k, "concurrency": c, "acceptance_length": r["acceptance_length"],
                     "tok_s": r["tok_s"], "tok_s_per_user": r["tok_s"] / c,
                     "over_none": r["tok_s"] / got["none"]["tok_s"],
                     "graphs": graphs_state(exs["peagle" if m == "none" else m])})
    best = {m: max((r["tok_s"] for r in rows if r["mode"] == m), default=None) for m in ("peagle", "eagle3")}
    for r in rows:
        r["peagle_over_eagle3"] = best["peagle"] / best["eagle3"] if r["mode"] == "peagle" and best["eagle3"] else None
        pub = [p for p in PUBLISHED if (p["target"], p["concurrency"], p["mode"]) == (name, c, r["mode"])]
        r["b200_tok_s (published)"] = pub[0].get("tok_s") if pub else None
        r["b200_over_eagle3 (published)"] = pub[0].get("over_eagle3") if pub else None
    progress(f"[seeds] {name} c={c}: " + ", ".join(f"{n} {got[n]['tok_s']:.0f} tok/s" for n in modes))
    return rows


def graphs_state(ex: TorchExecutor) -> str:
    if ex.graphs is None:
        return "off"
    return f"{len(ex.graphs.graphs)} captured, {len(ex.graphs.eager)} eager"


def section_curve(a, name: str, target, head) -> list[dict]:
    """Verify cost at batch 1 by rows: median ms (graph-replayed where the executor captures) and the
    distinct experts each MoE layer routed the rows to (an eager pass with hooks on the routers)."""
    ex, moe = executor(a, target, head, 1), target.config.moe
    tables = torch.tensor(blocks_of(ex.kv, ex.windows, 0), device=ex.device)[:, None]  # [G, 1, M]
    picked: list[int] = []

    def count(module, inputs, logits):  # the router's top-k, as both routing rules pick it
        picked.append(int(torch.topk(logits.float(), moe.top_k, dim=-1).indices.unique().numel()))

    gates = [m.gate for m in target.modules() if isinstance(m, SparseMoE)]
    rows = []
    for r in range(1, a.curve_rows + 1):
        tokens = torch.randint(0, target.config.vocab_size, (1, r), device=ex.device)
        positions = torch.arange(a.context, a.context + r, device=ex.device)[None]
        ms = median_ms(lambda: ex.target(tokens, positions, tables), max(a.rounds * a.steps, 3), a.warmup)
        hooks, picked[:] = [g.register_forward_hook(count) for g in gates], []
        try:
            with torch.inference_mode():
                target(tokens, positions, tables, ex.target_cache)
        finally:
            for h in hooks:
                h.remove()
        rows.append({"target": name, "rows": r, "ms": ms, "experts_mean": statistics.mean(picked),
                     "experts_max": max(picked), "uniform_expected": moe.num_experts * (
                         1 - (1 - moe.top_k / moe.num_experts) ** r), "experts": moe.num_experts})
    for row in rows:
        row["ms_over_1_row"] = row["ms"] / rows[0]["ms"]
    return rows


def section_adaptive(a, name: str, target, head, c: int) -> list[dict]:
    """none, adaptive K and every fixed K of a.adaptive_ks at concurrency c, alternated."""
    k_max = max(k for m, k in MODES[name] if m == "peagle")
    ks = int_list(a.adaptive_ks) or list(range(1, k_max + 1))
    ex = executor(a, target, head, c)
    contenders = {"none": Contender(ex, spec_for(name, "none", 0), c, a.context, a.steps),
                  f"adaptive K<={k_max}": Contender(ex, spec_for(name, "peagle", k_max, True), c, a.context, a.steps)}
    contenders |= {f"K={k}": Contender(ex, spec_for(name, "peagle", k), c, a.context, a.steps) for k in ks}
    for _ in range(a.adaptive_warmup):  # the rule explores k upwards one step at a time: let it settle first
        contenders[f"adaptive K<={k_max}"]()
    got = alternated(a, contenders)
    names = list(contenders)
    adaptive, fixed = names[1], names[2:]
    best = max(fixed, key=lambda n: got[n]["tok_s"])
    rounds = range(len(got[adaptive]["per_round"]))

    def ratio(x: str, y: str) -> float:
        return statistics.median(got[x]["per_round"][i] / got[y]["per_round"][i] for i in rounds)

    steps_at_k = dict(sorted(contenders[adaptive].decoder.draft_length.steps_at_k.items()))
    verdict = {"adaptive_over_none": ratio(adaptive, "none"), "adaptive_over_best_fixed": ratio(adaptive, best),
               "best_fixed": best, "adaptive_steps_at_k": steps_at_k}
    progress(f"[seeds] {name} adaptive c={c}: over none {verdict['adaptive_over_none']:.2f}x, over {best} "
             f"{verdict['adaptive_over_best_fixed']:.2f}x")
    return [{"target": name, "concurrency": c, "config": n, "tok_s": got[n]["tok_s"],
             "acceptance_length": got[n]["acceptance_length"], **(verdict if n == adaptive else {})} for n in names]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", default=",".join(SEEDS), help="comma-separated seed targets (default: %(default)s)")
    p.add_argument("--sections", default="table,curve,adaptive", help="which sections (default: %(default)s)")
    p.add_argument("--concurrency", default="1,8,64", help="requests decoding at once (default: %(default)s)")
    p.add_argument("--context", type=int, help="KV positions each request holds before the timed steps")
    p.add_argument("--steps", type=int, default=8, help="decode steps per contender and round (default: 8)")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds (default: 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default: 1)")
    p.add_argument("--curve-rows", type=int, default=16, help="verify cost curve: 1 .. this many rows (default: 16)")
    p.add_argument("--adaptive-ks", default="", help="fixed K compared with adaptive K (default: every 1 .. K)")
    p.add_argument("--layers", type=int, default=None, help="build only the first N layers (a labelled slice)")
    p.add_argument("--experts", choices=EXPERT_FORMATS, default=None, help="expert format (default: the seed's)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="eager forwards (default on CUDA: CUDA graphs)")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip the sections that would start later")
    p.add_argument("--small", action="store_true", help="SMALL widths (seed_models.py; what --smoke uses)")


class Sections:
    """Runs the sections under --budget-s: one that would start after the budget is skipped (listed);
    one that fails is recorded in res["errors"] and the run goes on (a time-boxed GPU run must not lose the
    others); its rows go to res[key]; OUTPUT_DIR/bench_seeds.json is rewritten after each."""

    def __init__(self, a, res: dict):
        self.a, self.res, self.t0 = a, res, time.monotonic()

    def __call__(self, label: str, key: str | None, fn) -> object:
        if time.monotonic() - self.t0 > self.a.budget_s:
            self.res["skipped"].append(label)
            return progress(f"[seeds] {label}: skipped (budget {self.a.budget_s:.0f} s spent)")
        progress(f"[seeds] {label} ...")
        try:
            out = fn()
            if key is not None:
                self.res[key] += out
            return out
        except Exception as exc:  # recorded and reported, not raised (the docstring's why)
            self.res["errors"][label] = f"{type(exc).__name__}: {exc}"
            progress(f"[seeds] {label} FAILED: {exc}")
        finally:
            if torch.cuda.is_available():  # the section's executors, caches and graphs go before the next
                gc.collect()
                torch.cuda.empty_cache()
            if self.a.output_dir is not None:
                (self.a.output_dir / "bench_seeds.json").write_text(json.dumps(self.res, indent=1, default=str))


def run(a: argparse.Namespace) -> dict:
    t0, device = time.monotonic(), torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not a.smoke:
        raise ConfigError("no CUDA device: the seeds' targets at their real shapes need one (torch.cuda.is_available() "
                          "is False); run it on an H100/H200 (scripts/gpu_validate.sh), or --smoke on the CPU")
    names, parts = a.targets.split(","), a.sections.split(",")
    if set(names) - set(SEEDS) or set(parts) - {"table", "curve", "adaptive"}:
        raise ConfigError(f"--targets from {sorted(SEEDS)}, --sections from table, curve, adaptive; got {a.targets!r}, "
                          f"{a.sections!r}")
    a.output_dir = a.output_dir or (None if a.smoke else Path(os.environ.get("OUT") or "gpu_results"))
    if a.output_dir is not None:
        a.output_dir.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a.kernels = "cuda" if device.type == "cuda" and cuda_kernels.available() else "reference"
    a.graphs = device.type == "cuda" and not a.no_cuda_graphs
    a.k_max = max(k for n in names for _, k in MODES[n])
    # rounds the adaptive rule runs alone first (it explores k upwards one step at a time): two steps per k
    a.adaptive_warmup = 1 if a.smoke else -(-2 * a.k_max // a.steps)
    a.max_len = a.context + (a.warmup + a.rounds + a.adaptive_warmup) * a.steps * (a.k_max + 1) + 2 * a.k_max + 8
    res = {"smoke": a.smoke, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "dtype": str(dtype), "kernels": a.kernels, "cuda_graphs": a.graphs, "context": a.context,
           "layers": a.layers, "built": [], "acceptance": acceptance_rows(names), "published": PUBLISHED,
           "table": [], "curve": [], "adaptive": [], "skipped": [], "errors": {}}
    section = Sections(a, res)
    for name in names:
        one_target(a, name, parts, section, device, dtype)
        if device.type == "cuda":  # the next target's build needs this one's memory
            gc.collect()
            torch.cuda.empty_cache()
    res["wall_s"], res["targets"] = round(time.monotonic() - t0, 1), check_targets(res)
    title = f"The seeds' targets ({'SMOKE run: small shapes, figures meaningless' if a.smoke else res['device']})"
    return finish(a, title, report(res, a), res, [Figure(t["target"], t["value"], "", t["goal"], 3)
                                                 for t in res["targets"] if t["value"] is not None])


def one_target(a, name: str, parts: list[str], section: Sections, device, dtype) -> None:
    """Target `name`: its build, then the sections of `parts` (table and adaptive per concurrency)."""
    built = section(f"{name}: build", None, lambda: build(a, name, device, dtype, section.res))
    if built is None:
        return
    target, heads = built
    for c in int_list(a.concurrency) if "table" in parts else ():
        section(f"{name}: table c={c}", "table", lambda: section_table(a, name, target, heads, c))
    if "curve" in parts:
        section(f"{name}: curve", "curve", lambda: section_curve(a, name, target, heads["peagle"]))
    for c in int_list(a.concurrency) if "adaptive" in parts else ():
        section(f"{name}: adaptive c={c}", "adaptive", lambda: section_adaptive(a, name, target, heads["peagle"], c))


def build(a, name: str, device, dtype, res: dict):
    t = time.monotonic()
    b = build_target(name, device, dtype, a.layers, a.small, a.experts)
    heads = {kind: build_head(name, kind, b.model, dtype) for kind in ("peagle", "eagle3")}
    c = b.model.config
    res["built"].append({"target": name, "layers": c.num_layers, "of_layers": SEEDS[name].config["num_hidden_layers"],
                         "hidden": c.hidden_size, "experts": f"{c.moe.num_experts} top {c.moe.top_k}",
                         "expert_format": b.experts, "how": b.experts_note, "attention_fp8": b.attention_fp8,
                         "weight_gb": b.weight_bytes / 1e9, "build_s": time.monotonic() - t,
                         "heads": {k: f"{h.config.num_layers} layers, intermediate {h.config.intermediate_size}, "
                                      f"draft vocabulary {h.config.draft_vocab_size}" for k, h in heads.items()},
                         "note": SEEDS[name].note})
    return b.model, heads


def acceptance_rows(names: list[str]) -> list[dict]:
    out = []
    for n in names:
        for m, k in MODES[n]:
            if m != "none":
                rates = synthetic_rates(n, m, k)
                out.append({"target": n, "mode": m, "k": k, "rates": [round(r, 3) for r in rates],
                            "expected_al": 1 + sum(rates), "source": ACCEPTANCE[(n, m)].source})
    return out


def check_targets(res: dict) -> list[dict]:
    """The issue's GPU targets on what was measured (value None where a figure is missing; met None on a
    layer slice, whose speed is not the model's)."""
    def tok(name, mode, c):
        got = [r["tok_s"] for r in res["table"] if (r["target"], r["mode"], r["concurrency"]) == (name, mode, c)]
        return max(got) if got else None

    q, sliced = "qwen3-coder-30b-a3b", {b["target"] for b in res["built"] if b["layers"] < b["of_layers"]}
    none, pe = tok(q, "none", 1), tok(q, "peagle", 1)
    adaptive = [r for r in res["adaptive"] if "adaptive_over_none" in r]
    checks = [(q, "none, c=1 (tok/s)", none, 600.0), (q, "P-EAGLE best K, c=1 (tok/s)", pe, 1000.0),
              (q, "P-EAGLE over none, c=1", pe and none and pe / none, 2.0)]
    for name in dict.fromkeys(r["target"] for r in adaptive):
        mine = [r for r in adaptive if r["target"] == name]
        checks += [(name, "adaptive over none, worst concurrency", min(r["adaptive_over_none"] for r in mine), 1.0),
                   (name, "adaptive over the best fixed K, worst concurrency",
                    min(r["adaptive_over_best_fixed"] for r in mine), 0.95)]
    for name in ("gpt-oss-20b", "gpt-oss-120b"):
        n, p, e = tok(name, "none", 1), tok(name, "peagle", 1), tok(name, "eagle3", 1)
        checks += [(name, "P-EAGLE over none, c=1 (reported)", p and n and p / n, None),
                   (name, "P-EAGLE over EAGLE-3, c=1 (reported)", p and e and p / e, None)]
    return [{"target": f"{name} {what}" + (" (LAYER SLICE)" if name in sliced else ""),
             "goal": f">= {goal}" if goal else "", "value": None if v is None else round(v, 3),
             "met": None if v is None or goal is None or name in sliced else v >= goal}
            for name, what, v, goal in checks]


def report(res: dict, a) -> list[str]:
    sliced = [b["target"] for b in res["built"] if b["layers"] < b["of_layers"]]
    out = [f"device {res['device']}, {res['dtype']}, custom ops {res['kernels']}, CUDA graphs {res['cuda_graphs']}; "
           f"random weights; context {res['context']}; {a.steps} steps x {a.rounds} rounds after {a.warmup}"
           + (f"; LAYER SLICES (not the models' speed): {sliced}" if sliced else ""),
           "### Targets", records(res["targets"], ["target", "goal", "value", "met"]),
           "### Built", records(res["built"], ["target", "layers", "of_layers", "experts", "expert_format", "how",
                                               "attention_fp8", "weight_gb", "build_s", "heads", "note"]),
           "### Synthetic acceptance (what each head is accepted at, and from which published figure)",
           records(res["acceptance"], ["target", "mode", "k", "expected_al", "rates", "source"]),
           "### Measured tok/s beside the seeds' published B200 figures",
           records(res["table"], ["target", "mode", "k", "concurrency", "acceptance_length", "tok_s_per_user", "tok_s",
                                  "over_none", "peagle_over_eagle3", "b200_tok_s (published)",
                                  "b200_over_eagle3 (published)", "graphs"], 2),
           "### Published (B200)", records(res["published"], ["target", "concurrency", "mode", "tok_s", "over_eagle3",
                                                               "over_none", "workload", "source"]),
           "### Verify cost curve, batch 1 (random weights route close to uniformly: the pessimistic case)",
           records(res["curve"], ["target", "rows", "ms", "ms_over_1_row", "experts_mean", "experts_max",
                                  "uniform_expected", "experts"], 2),
           "### Adaptive K vs every fixed K", records(res["adaptive"], [
               "target", "concurrency", "config", "tok_s", "acceptance_length", "adaptive_over_none",
               "adaptive_over_best_fixed", "best_fixed", "adaptive_steps_at_k"], 3),
           "\n".join([f"- skipped: {s}" for s in res["skipped"]] + [f"- FAILED {k}: {v}" for k, v in
                                                                     res["errors"].items()])]
    panels = [("verify cost, batch 1", "rows", "ms", series(res["curve"], "rows", "ms", lambda r: r["target"])),
              ("decode, tok/s in all", "concurrency", "tok/s", series(
                  res["table"], "concurrency", "tok_s", lambda r: f"{r['target']} {r['mode']} K={r['k']}"))]
    return out + [lines(a, "", panels, log2x=False)]
