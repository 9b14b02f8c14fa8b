"""Suite `heads` (docs/BENCHMARKS.md, "heads"): a real target (default the cached SmolLM2-135M) and its
two trained heads, P-EAGLE (one parallel drafter pass) vs EAGLE-3 (K sequential passes) vs none, in
process with the code that serves (TextGenerator: chat template, scheduler, onnxruntime). Prompt sets:
HumanEval (164), held-out instructions (modules the heads never saw), long (2K-token module sources).
Phases: (1) per configuration, batch 8: AL pooled over requests, per-position acceptance, tok/s,
T=0.7 at --sampled-ks, held-out and long at --set-ks; every greedy output equals none's (mismatches
0); (2) batch-1 speed: one 1-slot generator per configuration, passes alternated within rounds;
(3) --served: none and each head's best K in one tritonserver, alternated the same way.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

from peagle_trt.bench.acceptance import build_all, load_avg, pooled  # the code pair's suite
from peagle_trt.bench.harness import (
    Figure,
    alternate,
    finish,
    free_port,
    plot,
    progress,
    reported,
    stdout_to_stderr,
    summary,
    table,
)
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError, RuntimeInvariantError

HUMANEVAL_REQUEST = "Complete the following Python function:\n\n```python\n{prompt}```"
LONG_REQUEST = "Here is the Python module `{name}`:\n\n```python\n{source}\n```\n\nSummarize what this module does."


# -- prompt sets ------------------------------------------------------------------------------------

def prompt_sets(args, codec) -> dict[str, list[str]]:
    from peagle_trt.bench.prompts import humaneval_prompts
    from peagle_trt.train.instructions import instructions, split_of, stdlib_modules

    human = [HUMANEVAL_REQUEST.format(prompt=p["prompt"]) for p in humaneval_prompts()[:args.humaneval]]
    held = [r["prompt"] for r in instructions("heldout", seed=0) if r["kind"] not in ("long", "essay")]
    long_prompts = []
    for name, path in stdlib_modules():
        if split_of(name) != "heldout" or len(long_prompts) >= args.long:
            continue
        ids = codec.tok(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
        if len(ids) >= args.long_tokens:
            source = codec.tok.decode(ids[:args.long_tokens]).rsplit("\n", 1)[0]
            long_prompts.append(LONG_REQUEST.format(name=name, source=source))
    return {"humaneval": human, "heldout": held[:args.heldout], "long": long_prompts}


# -- running requests in-process ---------------------------------------------------------------------

def run_batch(gen, prompts: list[str], params: SamplingParams, conc: int) -> tuple[float, list[dict]]:
    """A closed loop of `conc` requests at a time on the calling thread; (wall s, results in order)."""
    from peagle_trt.serving.protocol import generate_result

    results: list[dict | None] = [None] * len(prompts)
    events: dict[int, list] = {}
    errors: list[str] = []
    todo = iter(range(len(prompts)))
    running = 0
    t0 = time.perf_counter()

    def submit(i: int) -> None:
        def on_event(ev, i=i) -> None:
            nonlocal running
            events.setdefault(i, []).append(ev)
            if ev.finished:
                if ev.error is not None:
                    errors.append(f"prompt {i}: {ev.error}")
                evs = events.pop(i)
                results[i] = generate_result("".join(e.text for e in evs), [t for e in evs for t in e.token_ids],
                                             ev.finish_reason, ev.stats or {})
                running -= 1
        gen.submit(f"bench-{i}", prompts[i], params, on_event, chat_template=True)

    while True:
        while running < conc:
            i = next(todo, None)
            if i is None:
                break
            running += 1
            submit(i)
        if not running:
            break
        gen.scheduler.step()
    if errors:
        raise RuntimeInvariantError(f"a benchmark request failed: {errors[0]}")
    return time.perf_counter() - t0, results


def generator(args, method: str, k: int, slots: int, max_seq_len: int):
    from peagle_trt.serving.generator import TextGenerator

    drafter = {"none": None, "peagle": args.peagle, "eagle3": args.eagle3}[method]
    spec = SpecConfig(method, k) if method != "none" else SpecConfig("none", 0)
    return TextGenerator.from_checkpoints(args.target, drafter, spec, max_seq_len=max_seq_len, max_batch=slots,
                                          backend=args.backend, threads=args.threads)


def configs_of(args) -> list[tuple[str, int]]:
    return [("none", 0)] + [(m, k) for m in ("peagle", "eagle3") for k in args.ks]


def acceptance_phase(args, sets: dict) -> list[dict]:
    greedy = SamplingParams(max_tokens=args.max_tokens)
    sampled = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=1)
    rows, ref = [], {}
    for method, k in configs_of(args):
        gen = generator(args, method, k, 8, args.long_tokens + 160)
        run_batch(gen, sets["humaneval"][:8], SamplingParams(max_tokens=8), 8)  # warm-up
        row: dict = {"method": method, "K": k}
        load0 = load_avg()
        wall, res = run_batch(gen, sets["humaneval"], greedy, 8)
        tokens = sum(len(r["token_ids"]) for r in res)
        row["humaneval"] = {**pooled(res, k), "tokens": tokens, "wall_s": round(wall, 2),
                            "tokens_per_s_b8": round(tokens / wall, 2), "load_before": load0}
        outputs = {"humaneval": [r["token_ids"] for r in res]}
        if k in args.sampled_ks:
            _, res = run_batch(gen, sets["humaneval"], sampled, 8)
            row["humaneval_t0.7"] = pooled(res, k)
        for name in ("heldout", "long"):
            if sets[name] and (method == "none" or k in args.set_ks):
                _, res = run_batch(gen, sets[name], greedy, 8 if name == "heldout" else 2)
                row[name] = pooled(res, k)
                outputs[name] = [r["token_ids"] for r in res]
        if method == "none":
            ref = outputs
        row["mismatches"] = sum(a != b for name, outs in outputs.items() for a, b in zip(outs, ref[name]))
        rows.append(row)
        progress(f"[heads] {method:6s} K={k:2d}: AL {row['humaneval']['acceptance_length']:.2f} "
                 f"({row['humaneval']['tokens_per_s_b8']:.1f} tok/s b8), mismatches {row['mismatches']}")
        del gen
        gc.collect()
    base = rows[0]["humaneval"]["tokens_per_s_b8"]
    for r in rows:
        r["speedup_b8"] = round(r["humaneval"]["tokens_per_s_b8"] / base, 3)
    return rows


def alternated(configs, repeats: int, run_pass, out: dict, reference=None) -> list[dict]:
    """`run_pass(c)` (-> (wall s, results)) for each configuration, alternated within `repeats`
    rounds; the rows: AL pooled, tok/s of the median pass, speed-up over the first configuration."""
    def one(c):
        def go() -> float:
            wall, out[c] = run_pass(c)
            return wall
        return go

    walls = alternate({c: one(c) for c in configs}, repeats, warmup=0, clock=reported,
                      on_round=lambda r: progress(f"[heads] batch-1 round {r + 1}/{repeats}"))
    rows = []
    for method, k in configs:
        res, wall = out[(method, k)], summary(walls[(method, k)])
        tokens = sum(len(r["token_ids"]) for r in res)
        rows.append({"method": method, "K": k, **pooled(res, k), "tokens": tokens,
                     "wall_s_passes": [round(w, 2) for w in walls[(method, k)]], "spread": round(wall["spread"], 3),
                     "tokens_per_s_b1": round(tokens / wall["median"], 2)})
        if reference is not None:
            rows[-1]["mismatches"] = sum(r["token_ids"] != a for r, a in zip(res, reference(out)))
    for r in rows:
        r["speedup_b1"] = round(r["tokens_per_s_b1"] / rows[0]["tokens_per_s_b1"], 3)
    return rows


def batch1_phase(args, prompts: list[str]) -> list[dict]:
    greedy = SamplingParams(max_tokens=args.max_tokens)
    configs = configs_of(args)
    gens = {c: generator(args, *c, 1, 1024) for c in configs}
    out: dict = {}

    for c in configs:
        run_batch(gens[c], prompts[:1], SamplingParams(max_tokens=8), 1)  # warm-up
    return alternated(configs, args.timing_repeats, lambda c: run_batch(gens[c], prompts, greedy, 1), out)


def served_phase(args, prompts: list[str], best: dict) -> list[dict]:
    """none and the best K of each head in one tritonserver, batch-1 passes interleaved."""
    from peagle_trt.serving.client import stream_generate
    from peagle_trt.serving.server import ServeOptions, TritonServer

    configs = [("none", 0)] + [(m, best[m]) for m in ("peagle", "eagle3") if m in best]
    root = args.workdir / "repo"
    build_all(root, args.target, {"peagle": args.peagle, "eagle3": args.eagle3}, configs, backend=args.backend,
              max_batch=1, max_seq_len=1024)
    greedy = SamplingParams(max_tokens=args.max_tokens)
    out: dict = {}
    serve = ServeOptions(root, "127.0.0.1", free_port(), free_port(), free_port(), ready_timeout_s=600,
                         log_path=args.workdir / "tritonserver.log")
    with TritonServer(serve) as server:
        def run_pass(c):
            t0 = time.perf_counter()
            res = [stream_generate(server.grpc_url, p, greedy, f"{c[0]}_k{c[1]}", chat_template=True) for p in prompts]
            return time.perf_counter() - t0, res

        for c in configs:
            stream_generate(server.grpc_url, prompts[0], SamplingParams(max_tokens=8), f"{c[0]}_k{c[1]}",
                            chat_template=True)
        return alternated(configs, args.timing_repeats, run_pass, out,
                          lambda o: [r["token_ids"] for r in o[configs[0]]])


# -- report -----------------------------------------------------------------------------------------

def rows_table(rows: list[dict], b1: list[dict]) -> str:
    speed = {(r["method"], r["K"]): r for r in b1}
    body = []
    for r in rows:
        s = speed.get((r["method"], r["K"]), {})
        h = r["humaneval"]
        cells = [r["method"], r["K"], f"{h['acceptance_length']:.2f}"]
        for key in ("humaneval_t0.7", "heldout", "long"):
            cells.append(f"{r[key]['acceptance_length']:.2f}" if key in r else "")
        cells += [" ".join(f"{p:.2f}" for p in h["accept_rate_per_pos"]),
                  f"{s['tokens_per_s_b1']:.1f}" if s else "", f"{s['speedup_b1']:.2f}" if s else "",
                  f"{h['tokens_per_s_b8']:.1f}", f"{r['speedup_b8']:.2f}", r["mismatches"]]
        body.append(cells)
    return table(["method", "K", "AL HumanEval", "AL T=0.7", "AL held-out", "AL long", "per-position",
                           "tok/s b1", "x none", "tok/s b8", "x none", "mismatches"], body)


def drawing(rows: list[dict], b1: list[dict]):
    def draw(plt):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for method, color, name in (("peagle", "tab:blue", "P-EAGLE"), ("eagle3", "tab:orange", "EAGLE-3")):
            rs = [r for r in rows if r["method"] == method]
            bs = [r for r in b1 if r["method"] == method]
            ax1.plot([r["K"] for r in rs], [r["humaneval"]["acceptance_length"] for r in rs], "o-", color=color,
                     label=f"{name} greedy")
            samp = [r for r in rs if "humaneval_t0.7" in r]
            if samp:
                ax1.plot([r["K"] for r in samp], [r["humaneval_t0.7"]["acceptance_length"] for r in samp], "s--",
                         color=color, label=f"{name} T=0.7")
            ax2.plot([r["K"] for r in bs], [r["speedup_b1"] for r in bs], "o-", color=color, label=f"{name} batch 1")
            ax2.plot([r["K"] for r in rs], [r["speedup_b8"] for r in rs], "s--", color=color, label=f"{name} batch 8")
        ax2.axhline(1.0, color="gray", lw=0.8)
        ax1.set(xlabel="K (draft tokens per step)", ylabel="acceptance length", title="HumanEval, SmolLM2-135M")
        ax2.set(xlabel="K (draft tokens per step)", ylabel="speed-up over none (in-process)", title="Wall-clock")
        return fig
    return draw


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, default=None, help="target dir (default: the cached SmolLM2)")
    p.add_argument("--peagle", type=Path, default=None, help="P-EAGLE head directory (required)")
    p.add_argument("--eagle3", type=Path, default=None, help="EAGLE-3 head directory (required)")
    p.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "torch"])
    p.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads (default: its own)")
    p.add_argument("--ks", default="1,3,5,7,10", help="K of both heads")
    p.add_argument("--sampled-ks", default="3,7", help="K measured at T=0.7 too")
    p.add_argument("--set-ks", default="7", help="K measured on the held-out and long sets too")
    p.add_argument("--humaneval", type=int, default=164, help="HumanEval problems")
    p.add_argument("--heldout", type=int, default=48, help="held-out instructions")
    p.add_argument("--long", type=int, default=6, help="long-context prompts")
    p.add_argument("--long-tokens", type=int, default=2048, help="tokens of module source per long prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--timing-prompts", type=int, default=6, help="HumanEval prompts of a batch-1 pass")
    p.add_argument("--timing-repeats", type=int, default=3, help="batch-1 rounds (median reported)")
    p.add_argument("--served", action="store_true", help="also the served batch-1 phase (tritonserver)")
    p.add_argument("--workdir", type=Path, default=Path("artifacts/bench_heads"), help="served repository")


def run(args: argparse.Namespace) -> dict:
    from peagle_trt.demo import code_pair
    from peagle_trt.tokenizer import TextCodec

    if args.smoke:
        pair = code_pair()
        args.target, args.peagle, args.eagle3 = pair, pair / "drafter-peagle", pair / "drafter-eagle3"
        args.ks, args.sampled_ks, args.set_ks, args.humaneval, args.heldout, args.long = "3", "3", "3", 4, 2, 1
        args.long_tokens, args.max_tokens, args.timing_prompts, args.timing_repeats = 200, 8, 1, 1
        args.backend = "torch"
    if args.target is None:
        from peagle_trt.convert.packaged import cached_target

        args.target = cached_target("smollm2", progress=progress)
    if args.peagle is None or args.eagle3 is None:
        raise ConfigError("pass both heads: --peagle DIR --eagle3 DIR (scripts/make_smollm2_heads.py trains them)")
    args.ks, args.sampled_ks, args.set_ks = ([int(x) for x in s.split(",") if x.strip()]
                                             for s in (args.ks, args.sampled_ks, args.set_ks))
    t0 = time.perf_counter()
    sets = prompt_sets(args, TextCodec(args.target))
    progress("[heads] prompts: " + ", ".join(f"{k} {len(v)}" for k, v in sets.items()))
    with stdout_to_stderr():
        rows = acceptance_phase(args, sets)
        b1 = batch1_phase(args, sets["humaneval"][:args.timing_prompts])
        best = {m: max((r for r in b1 if r["method"] == m), key=lambda r: r["tokens_per_s_b1"])["K"]
                for m in ("peagle", "eagle3")}
        served = None
        if args.served:
            args.workdir.mkdir(parents=True, exist_ok=True)
            served = served_phase(args, sets["humaneval"][:args.timing_prompts], best)
    plot_name = plot(args, "", drawing(rows, b1))
    sections = [f"HumanEval {len(sets['humaneval'])} prompts, held-out {len(sets['heldout'])}, long "
                f"{len(sets['long'])} ({args.long_tokens}-token sources); {args.max_tokens} new tokens at most",
                rows_table(rows, b1)]
    if served:
        sections += ["### Served by tritonserver, batch 1 (alternated)", table(
            ["method", "K", "AL", "tok/s b1", "x none", "mismatches"],
            [[r["method"], r["K"], f"{r['acceptance_length']:.2f}", f"{r['tokens_per_s_b1']:.1f}",
              f"{r['speedup_b1']:.2f}", r["mismatches"]] for r in served])]
    sections.append(f"![{plot_name}]({plot_name})" if plot_name else "")
    figures = [Figure(f"{Path(args.target).name} heads, batch 1, {r['method']} K={r['K']} over none (in-process)",
                      r["speedup_b1"], "x") for r in b1 if r["method"] != "none" and r["K"] == best[r["method"]]]
    figures += [Figure(f"{Path(args.target).name} heads, HumanEval AL, {r['method']} K={r['K']}",
                       r["humaneval"]["acceptance_length"], "") for r in rows if r["method"] != "none"
                and r["K"] == best[r["method"]]]
    return finish(args, f"{Path(args.target).name}: P-EAGLE vs EAGLE-3 vs none (in-process, {args.backend})",
                  sections, {"target": str(args.target), "peagle": str(args.peagle), "eagle3": str(args.eagle3),
                             "backend": args.backend, "sets": {k: len(v) for k, v in sets.items()},
                             "max_tokens": args.max_tokens, "rows": rows, "batch1": b1, "best_k_b1": best,
                             "served": served, "total_s": round(time.perf_counter() - t0, 1)}, figures)
