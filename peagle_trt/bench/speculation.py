"""Suite `speculation` (docs/BENCHMARKS.md, "speculation"): a real target and a P-EAGLE head in process
(peagle_trt/bench/measure.py), batch 1 and 8, configurations alternated within rounds. Parts: `synthetic` (K drafts
accepted by vLLM's synthetic rule at mean acceptance lengths --als: speed as a function of AL; output is
NOT the target's), `adaptive` (none, fixed K and adaptive K on HumanEval, held-out instructions and a
mix; `verdicts`), `per-request` (each request alone: speed-ups by kind and the per-request `oracle`).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from peagle_trt.bench.harness import Figure, finish, int_list, lines, options, records, series, stdout_to_stderr
from peagle_trt.bench.measure import Config, head, measure, prompt_sets
from peagle_trt.config import SpecConfig
from peagle_trt.speculative_config import synthetic_rates_for_length


def passes(args, specs: dict[str, SpecConfig], workloads: dict[str, list[str]], batch: int) -> list[dict]:
    """peagle_trt/bench/measure.py's alternated passes, one configuration per named spec (the P-EAGLE
    head unless none)."""
    configs = [Config(name, s, None if s.mode == "none" else args.peagle) for name, s in specs.items()]
    return measure(args, configs, workloads, [batch], args.long_tokens + 256)


def verdicts(rows: list[dict]) -> list[dict]:
    """Per (workload, batch): adaptive over the best fixed K (none included), the median over rounds
    of their tok/s ratio in the same round (adjacent passes see the same load). The best fixed K:
    in-sample, the best median over all rounds (`adaptive_over_best_fixed`: the winner's curse reads
    adaptive low); held out (from 2 rounds), per round the best over the OTHER rounds (`..._held_out`)."""
    def speed(r: dict, i: int) -> float:
        return r["tokens"] / r["wall_s_passes"][i]

    out = []
    for w, b in sorted({(r["workload"], r["batch"]) for r in rows if r["adaptive"]}):
        cell = [r for r in rows if (r["workload"], r["batch"]) == (w, b)]
        fixed = [r for r in cell if not r["adaptive"]]
        adaptive = next(r for r in cell if r["adaptive"])
        rounds = range(len(adaptive["wall_s_passes"]))
        best = max(fixed, key=lambda r: r["tokens_per_s"])
        per_round = [speed(adaptive, i) / speed(best, i) for i in rounds]
        verdict = {"workload": w, "batch": b, "best_fixed": best["config"],
                   "adaptive_over_best_fixed": round(statistics.median(per_round), 3),
                   "per_round": [round(x, 3) for x in per_round]}
        if len(rounds) > 1:
            picks = [max(fixed, key=lambda r: statistics.median(speed(r, j) for j in rounds if j != i))
                     for i in rounds]
            held = [speed(adaptive, i) / speed(p, i) for i, p in zip(rounds, picks)]
            verdict.update(adaptive_over_best_fixed_held_out=round(statistics.median(held), 3),
                           per_round_held_out=[round(x, 3) for x in held],
                           best_fixed_held_out=[p["config"] for p in picks])
        out.append(verdict)
    return out


def oracle(rows: list[dict]) -> list[dict]:
    """From `measure`'s rows of one-request workloads named KIND/I: per kind and over every request
    (`mixed`), each configuration's speed-up over none (total median walls), the best fixed K and the
    per-request oracle (each request with its fastest fixed configuration): a bound on what one k per
    request could gain; it picks on the walls it is judged on, so it reads high."""
    walls: dict = {}  # request -> config -> median wall
    for r in rows:
        walls.setdefault(r["workload"], {})[r["config"]] = statistics.median(r["wall_s_passes"])
    fixed = list(dict.fromkeys(r["config"] for r in rows if not r["adaptive"]))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    out = []
    for kind in [*dict.fromkeys(w.split("/")[0] for w in walls), "mixed"]:
        cell = [v for w, v in walls.items() if kind in ("mixed", w.split("/")[0])]
        total = {c: sum(v[c] for v in cell) for c in configs}
        best = min(fixed, key=total.get)
        oracle_wall = sum(min(v[c] for c in fixed) for v in cell)
        out.append({"kind": kind, "requests": len(cell), "best_fixed": best,
                    "speedup": {c: round(total["none"] / total[c], 3) for c in configs},
                    "oracle_over_best_fixed": round(total[best] / oracle_wall, 3),
                    "adaptive_over_best_fixed": {c: round(total[best] / total[c], 3) for c in configs
                                                 if c not in fixed}})
    return out


VERDICT_COLUMNS = ["workload", "batch", "best_fixed", "adaptive_over_best_fixed", "per_round",
                   "adaptive_over_best_fixed_held_out", "best_fixed_held_out", "per_round_held_out"]


SMOKE = dict(target="code-pair", peagle=None, backend="torch", k=3, als="1,4", fixed_ks="1,3", prompts=1,
             long_tokens=200, max_tokens=6, rounds=1, per_request=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    options(p, target="smollm2", backend="onnxruntime", threads=None, prompts=4, max_tokens=64, rounds=2)
    p.add_argument("--peagle", type=Path, default=None, help="P-EAGLE head (default TARGET/drafter-peagle)")
    p.add_argument("--k", type=int, default=7, help="K of the synthetic sweep and adaptive K's cap")
    p.add_argument("--als", default="1,2,4,6,8", help="synthetic mean acceptance lengths")
    p.add_argument("--fixed-ks", default="1,3,5,7", help="fixed K compared with adaptive K")
    p.add_argument("--long-tokens", type=int, default=2048, help="tokens of module source per long prompt")
    p.add_argument("--per-request", type=int, default=3, help="requests of each kind in the per-request part")
    p.add_argument("--parts", default="synthetic,adaptive,per-request", help="which parts to run")


def run(args: argparse.Namespace) -> dict:
    from peagle_trt.tokenizer import TextCodec

    args.peagle = head(args, "peagle", args.peagle)
    n = args.prompts
    sets = prompt_sets(TextCodec(args.target), 2 * n, 2 * n, max(1, n // 2), args.long_tokens)
    mixed = [p for trio in zip(sets["humaneval"], sets["heldout"], sets["long"] * n) for p in trio][:2 * n]
    synthetic, adaptive, requests = [], [], []
    swept = {"none": SpecConfig("none", 0)}  # the synthetic sweep: K drafts accepted at a mean length
    for al in map(float, args.als.split(",")):
        rates = synthetic_rates_for_length(al, args.k)
        swept[f"synthetic AL {al:g}"] = SpecConfig("peagle", args.k, synthetic_rates=rates)
    # none, adaptive, then the fixed K: adaptive's passes sit right after none's in each round
    compared = {"none": SpecConfig("none", 0), f"adaptive (K<={args.k})": SpecConfig("peagle", args.k, adaptive=True)}
    compared |= {f"K={k}": SpecConfig("peagle", k) for k in int_list(args.fixed_ks)}
    with stdout_to_stderr():
        for b, m in ((1, n), (8, 2 * n)):  # batch, requests per workload
            if "synthetic" in args.parts:
                synthetic += passes(args, swept, {"humaneval": sets["humaneval"][:m]}, b)
            if "adaptive" in args.parts:
                workloads = {"humaneval": sets["humaneval"][:m], "heldout": sets["heldout"][:m],
                             "mixed": mixed[:m if b == 8 else n + 1]}
                adaptive += passes(args, compared, workloads, b)
        if "per-request" in args.parts:
            m = args.per_request
            alone = prompt_sets(TextCodec(args.target), m, m, m, args.long_tokens)
            requests = passes(args, compared, {f"{kind}/{i}": [p] for kind, ps in alone.items()
                                               for i, p in enumerate(ps)}, 1)
    by_kind = oracle(requests) if requests else []
    panels = [("speed vs acceptance length", "mean acceptance length (synthetic)", "speed-up over none",
               series([r for r in synthetic if r["synthetic_acceptance"]], "acceptance_length", "speedup",
                      lambda r: f"batch {r['batch']}")),
              ("adaptive K vs fixed K", "workload, batch", "speed-up over none",
               series(adaptive, lambda r: f"{r['workload']} b{r['batch']}", "speedup", lambda r: r["config"]))]
    plot_name = lines(args, "", panels) if synthetic or adaptive else None
    verdict = verdicts(adaptive) if adaptive else []
    figures = [Figure(f"{Path(args.target).name}: adaptive K over the best fixed K, {v['workload']} batch {v['batch']}",
                      v.get("adaptive_over_best_fixed_held_out", v["adaptive_over_best_fixed"]), "x", ">= 0.97x", 3)
               for v in verdict if v["workload"] == "mixed"]
    figures += [Figure(f"{Path(args.target).name}: per-request oracle over the best fixed K (mix, batch 1)",
                       v["oracle_over_best_fixed"], "x", "", 3) for v in by_kind if v["kind"] == "mixed"]
    columns = ["workload", "batch", "config", "acceptance_length", "tokens_per_s", "speedup", "mismatches"]
    return finish(args, f"{Path(args.target).name}: speculation controls (in-process, {args.backend})", [
        f"### Synthetic acceptance, K = {args.k}" if synthetic else "", records(synthetic, columns),
        "### Adaptive K vs fixed K" if adaptive else "", records(adaptive, columns), records(verdict, VERDICT_COLUMNS),
        "### Per request (batch 1): speed-ups by kind, the per-request oracle" if by_kind else "",
        records(by_kind, ["kind", "requests", "best_fixed", "speedup", "oracle_over_best_fixed",
                          "adaptive_over_best_fixed"]), plot_name],
                  {"synthetic": synthetic, "adaptive": adaptive, "adaptive_vs_best_fixed": verdict,
                   "per_request": requests, "per_kind": by_kind, "plot": plot_name}, figures)
