"""Suites `heads`, `acceptance` and `step-cost` (docs/BENCHMARKS.md, one section each), presets of this
module (PRESETS): a target and its two trained heads, P-EAGLE vs EAGLE-3 vs none, in process with the
code that serves (peagle_trt/bench/measure.py): batch 8 per configuration (AL pooled, per-position acceptance, T = 0.7,
held-out and long sets, outputs vs none's); batch 1 with passes alternated and the executor's forwards
timed (where a step's time goes); then none and each head's best batch-1 K alternated at batch 8 (tok/s)
and, with --served, in one tritonserver at batch 1.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

from peagle_trt.bench.harness import (
    Figure,
    finish,
    int_list,
    lines,
    options,
    progress,
    records,
    series,
    stdout_to_stderr,
    table,
)
from peagle_trt.bench.measure import (
    Config,
    code_prompts,
    generator,
    head,
    measure,
    pooled,
    prompt_sets,
    run_batch,
    served,
)
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError

ALL_KS = "none,peagle:1,peagle:3,peagle:5,peagle:7,peagle:10,eagle3:1,eagle3:3,eagle3:5,eagle3:7"
PRESETS = {  # suite -> its defaults (options and the figures' targets)
    "heads": dict(target="smollm2", chat=True, backend="onnxruntime", configs=ALL_KS + ",eagle3:10",
                  sampled_ks="3,7", set_ks="7", heldout=48, long=6, max_tokens=128, timing_prompts=6, served=False,
                  al_target=">= 2.5", al_at_best=True, speed_target=">= 1.6x", served_target=">= 1.4x",
                  workdir=Path("artifacts/bench_heads")),
    "acceptance": dict(configs=ALL_KS, sampled_ks="all", prompts=164, max_tokens=32, timing_prompts=40,
                       al_target=">= 2.5", speed_target=">= 1.5x", workdir=Path("artifacts/bench_acceptance")),
    "step-cost": dict(configs="none,peagle:3,peagle:5,peagle:7,eagle3:3,eagle3:5", batch8=False, served=False,
                      prompts=16, max_tokens=64, timing_prompts=16),
}
B8_PROMPTS = 16  # HumanEval prompts of the alternated batch-8 phase: two full batches
SMOKE = dict(target="code-pair", backend="torch", configs="none,peagle:3,eagle3:3", set_ks="3",
             prompts=4, heldout=2, long=1, long_tokens=200, max_tokens=8, timing_prompts=2, rounds=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peagle", type=Path, default=None, help="P-EAGLE head (default TARGET/drafter-peagle)")
    p.add_argument("--eagle3", type=Path, default=None, help="EAGLE-3 head (default TARGET/drafter-eagle3)")
    p.add_argument("--configs", default=ALL_KS, help="comma-separated none | METHOD:K")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=False,
                   help="prompts through the chat template (else raw code, cut to --prompt-tokens)")
    p.add_argument("--sampled-ks", default="", help="K measured at T=0.7 too (all: every K)")
    p.add_argument("--set-ks", default="", help="K measured on the held-out and long sets too (--chat)")
    p.add_argument("--heldout", type=int, default=0, help="held-out instructions (--chat)")
    p.add_argument("--long", type=int, default=0, help="long-context prompts (--chat)")
    p.add_argument("--long-tokens", type=int, default=2048, help="tokens of module source per long prompt")
    p.add_argument("--prompt-tokens", type=int, default=224, help="raw prompts: their last lines within this")
    p.add_argument("--timing-prompts", type=int, default=40,
                   help="HumanEval prompts of a batch-1 pass (0: acceptance only, no timed phase)")
    p.add_argument("--batch8", action=argparse.BooleanOptionalAction, default=True,
                   help="the batch-8 phases (acceptance per configuration; timing alternated)")
    p.add_argument("--served", action=argparse.BooleanOptionalAction, default=True,
                   help="the served batch-1 phase (tritonserver)")
    options(p, target="code-pair", backend="torch", threads=None, prompts=164, max_tokens=32, rounds=3,
            workdir=Path("artifacts/bench_pair"))
    p.set_defaults(al_target="", al_at_best=False, speed_target="", served_target="")  # set by PRESETS


def batch8(args, configs: list[Config], sets: dict, max_seq_len: int) -> list[dict]:
    """Per configuration (one at a time), batch 8 on HumanEval: AL pooled, per-position acceptance;
    T = 0.7 at args.sampled_ks; held-out and long sets at args.set_ks; outputs vs none's. Not timed:
    one configuration after another is no speed measurement (the alternated phases are)."""
    greedy = SamplingParams(max_tokens=args.max_tokens)
    sampled = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=1)
    rows, ref = [], {}
    for c in configs:
        gen, k = generator(args, c, 8, max_seq_len), c.spec.num_spec_tokens
        run_batch(gen, sets["humaneval"][:8], SamplingParams(max_tokens=8), 8, args.chat)  # warm-up
        _, res = run_batch(gen, sets["humaneval"], greedy, 8, args.chat)
        row: dict = {"config": c.name, "method": c.spec.mode, "K": k, "humaneval": pooled(res, k)}
        outputs = {"humaneval": [r["token_ids"] for r in res]}
        if k in args.sampled_ks or (k and args.sampled_ks == "all"):
            row["humaneval_t0.7"] = pooled(run_batch(gen, sets["humaneval"], sampled, 8, args.chat)[1], k)
        for name in ("heldout", "long"):
            if sets.get(name) and (not k or k in args.set_ks):
                _, res = run_batch(gen, sets[name], greedy, 8 if name == "heldout" else 2, args.chat)
                row[name], outputs[name] = pooled(res, k), [r["token_ids"] for r in res]
        ref = ref or outputs
        row["mismatches"] = sum(a != b for name, outs in outputs.items() for a, b in zip(outs, ref[name]))
        rows.append(row)
        progress(f"[{args.suite}] {c.name}: AL {row['humaneval']['acceptance_length']:.2f}, mismatches "
                 f"{row['mismatches']}")
        del gen
        gc.collect()
    return rows


def batch8_table(rows: list[dict]) -> str:
    def al(r, key):
        return f"{r[key]['acceptance_length']:.2f}" if key in r else ""

    return table(["method", "K", "AL HumanEval", "AL T=0.7", "AL held-out", "AL long", "per-position", "mismatches"],
                 [[r["method"], r["K"], *(al(r, k) for k in ("humaneval", "humaneval_t0.7", "heldout", "long")),
                   " ".join(f"{p:.2f}" for p in r["humaneval"]["accept_rate_per_pos"]), r["mismatches"]]
                  for r in rows])


def run(args: argparse.Namespace) -> dict:
    from peagle_trt.tokenizer import TextCodec

    if args.smoke:
        args.sampled_ks = "3" if args.chat else ""
    heads, configs = {}, []
    for item in args.configs.split(","):
        method, _, k = item.partition(":")
        if method not in ("none", "peagle", "eagle3") or (method != "none" and not k.isdigit()):
            raise ConfigError(f"--configs: {item!r} is not none or METHOD:K with METHOD peagle or eagle3")
        if method != "none":
            heads[method] = head(args, method, getattr(args, method))
        configs.append(Config("none", SpecConfig("none", 0), None) if method == "none"
                       else Config(f"{method} K={k}", SpecConfig(method, int(k)), heads[method]))
    args.sampled_ks = args.sampled_ks if args.sampled_ks == "all" else int_list(args.sampled_ks)
    args.set_ks = int_list(args.set_ks)
    codec = TextCodec(args.target)
    if args.chat:
        sets = prompt_sets(codec, args.prompts, args.heldout, args.long, args.long_tokens)
        max_seq_len = args.long_tokens + args.max_tokens + 64
    else:
        sets = {"humaneval": code_prompts(codec.tok, args.prompts, args.prompt_tokens)}
        max_seq_len = args.prompt_tokens + args.max_tokens + 16
    label, rows, serve = Path(args.target).name, [], []
    with stdout_to_stderr():  # tritonserver and the model build print on fd 1
        if args.batch8:
            rows = batch8(args, configs, sets, max_seq_len)
        b1 = measure(args, configs, {"humaneval": sets["humaneval"][:args.timing_prompts]}, [1], max_seq_len,
                     args.chat, timers={}) if args.timing_prompts else []  # 0: acceptance only
        best = {m: max((r for r in b1 if r["method"] == m), key=lambda r: r["tokens_per_s"])["K"]
                for m in ("peagle", "eagle3") if any(r["method"] == m for r in b1)}
        # none and each head's best K
        fastest = [c for c in configs if c.spec.num_spec_tokens == best.get(c.spec.mode, 0)]
        b8 = measure(args, fastest, {"humaneval": sets["humaneval"][:B8_PROMPTS]}, [8], max_seq_len, args.chat) \
            if args.batch8 and b1 else []
        if args.served and b1:
            args.workdir.mkdir(parents=True, exist_ok=True)
            serve = served(args, fastest, sets["humaneval"][:args.timing_prompts], max_seq_len, args.chat)
    spec = [r for r in rows if r["method"] != "none"]  # the plot's series: by K, per head
    al = {**series(spec, "K", lambda r: r["humaneval"]["acceptance_length"], lambda r: f"{r['method']} greedy"),
          **series([r for r in spec if "humaneval_t0.7" in r], "K", lambda r: r["humaneval_t0.7"]["acceptance_length"],
                   lambda r: f"{r['method']} T=0.7")}
    speed = {**series([r for r in b1 if r["method"] != "none"], "K", "speedup", lambda r: f"{r['method']} batch 1"),
             **series([r for r in b8 if r["method"] != "none"], "K", "speedup", lambda r: f"{r['method']} batch 8")}
    panels = [(f"HumanEval, {label}", "K (draft tokens per step)", "acceptance length", al)]
    panels += [("Wall-clock", "K (draft tokens per step)", "speed-up over none", speed)] if speed else []
    png = lines(args, "", panels) if rows else None
    al_k = best.get("peagle") if args.al_at_best else 7  # heads: the AL at the K the speed-ups are quoted at
    figures = [Figure(f"{label}, HumanEval AL, {r['method']} K={r['K']}", r["humaneval"]["acceptance_length"], "",
                      args.al_target) for r in rows if r["method"] == "peagle" and r["K"] == al_k]
    figures += [Figure(f"{label}, HumanEval batch {r['batch']}, {r['method']} K={r['K']} over none ({where}, CPU)",
                       r["speedup"], "x", target if r["method"] == "peagle" else "")  # the baseline has no target
                for where, rs, target in (("in-process", b1, args.speed_target), ("in-process", b8, ""),
                                          ("served", serve, args.served_target))
                for r in rs if r["method"] != "none" and r["K"] == best[r["method"]]]
    columns = ["config", "acceptance_length", "tokens_per_s", "speedup", "ms_per_step", "target_ms", "drafter_ms",
               "other_ms", "mismatches"]
    return finish(args, f"{label}: P-EAGLE vs EAGLE-3 vs none ({args.backend})", [
        f"HumanEval {len(sets['humaneval'])} prompts, held-out {len(sets.get('heldout', []))}, long "
        f"{len(sets.get('long', []))}; {args.max_tokens} new tokens at most; " + (
            f"batch 1: medians of {args.rounds} alternated passes over {args.timing_prompts} prompts" if b1
            else "acceptance only (no timed phase)"), batch8_table(rows) if rows else "",
        "### Batch 1, in process: where a step's time goes (ms)" if b1 else "", records(b1, columns),
        f"### Batch 8, in process: none and each head's batch-1 best K (alternated; {B8_PROMPTS} prompts)"
        if b8 else "",
        records(b8, columns[:4] + columns[-1:]),
        "### Served by tritonserver, batch 1 (alternated)" if serve else "", records(serve, columns[:4] + columns[-1:]),
        png],
        {"heads": {m: str(h) for m, h in heads.items()}, "sets": {k: len(v) for k, v in sets.items()}, "rows": rows,
         "batch1": b1, "best_k_b1": best, "batch8": b8, "served": serve or None}, figures)
