"""Suite `long-context` (docs/BENCHMARKS.md, "long-context"): acceptance, decode speed and time to first
token against context length, none vs EAGLE-3 vs P-EAGLE, batch 1, in process through the code that
serves (TextGenerator and its scheduler; peagle_trt/bench/measure.py), backend onnxruntime by default.

    peagle-trt bench long-context [--target smollm2] [--contexts 512,2048,4096,8192] [--prompts 1]
        [--configs none,peagle:3,eagle3:3] [--heads peagle-long=DIR] [--max-tokens 32] [--rounds 1]

Prompts (peagle_trt/bench/long_prompts.py): per context, --prompts of each kind, "source" (whole
held-out module files, then a request about a function of the last) and "chat" (held-out turns of the
self-distillation answers, then a new request), of at most the context's tokens, chat template
included; a context is capped at the target's max_position_embeddings - --max-tokens - MARGIN (8192
becomes 8128 on SmolLM2 with 32 new tokens); the report gives the actual counts.
Per context, one generator per configuration, its KV sized for that context (so a step reads what the
context needs, not a longer allocation), prefix caching on: round 1 runs every prompt cold and gives
the TTFT (submit to first token: the prefill, target and drafter); later rounds reuse the cached
prompt and time decoding again. Within a prompt the configurations take turns, the order reversed
every other round (and prompt, and context). Decode tok/s counts only the tokens after the first
and the time after it (the decode steps); its median over rounds is what the speed-up over none
(same context) compares. AL and per-position acceptance pool the verify steps of all prompts; every
greedy output is compared with none's (mismatches: the gate, 0). Each finished context's rows are
appended to OUTPUT_DIR/bench_long_context_rows.jsonl at once (a run stopped early keeps them).
Defaults, sized by the prefill: on a 2-core CPU an 8K prompt's prefill takes minutes (attention in
256-token chunks over everything before), and every configuration prefills every prompt itself, so
the cost is configurations x prompts x prefill; 3 configurations, one prompt of each kind, one round
and 32 new tokens took 46 minutes on a 2-core machine other jobs kept at load 6-9 (2026-12-01).
K = 3 for both heads: acceptance shows to position 3 (both reach ~98% of their K = 5 AL on short
prompts, docs/BENCHMARKS.md "heads"), and at long contexts a step's time is the attention over the
KV, which a 4-row verify reads once like a 1-row one (at 8K a K = 3 step cost 3-12% more than the
target's plain step, "long-context"). K = 1 is the fastest batch-1 K on short prompts: add
peagle:1,eagle3:1 to --configs to compare.
--heads NAME=DIR adds a head (its method read from its config.json), configured as NAME:K.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from pathlib import Path

from peagle_trt.bench.harness import (
    Figure,
    finish,
    int_list,
    lines,
    options,
    progress,
    series,
    stdout_to_stderr,
    table,
)
from peagle_trt.bench.measure import Config, generator, pooled
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError, RuntimeInvariantError

SHIPPED_HEADS = Path(__file__).resolve().parents[2] / "tests" / "data" / "smollm2-heads"
MARGIN = 32  # positions kept free past prompt + max tokens (verify rows, drafter mask rows)
DEFAULT_CONFIGS = "none,peagle:3,eagle3:3"
# one torch thread: the 1 M-parameter pair ran 5x faster than on two cores other jobs keep busy
SMOKE = dict(target="code-pair", backend="torch", threads=1, contexts="256,384", prompts=1, max_tokens=6, rounds=1,
             configs="none,peagle:3,eagle3:3")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default="512,2048,4096,8192", help="prompt tokens per context (default: %(default)s)")
    p.add_argument("--kinds", default="source,chat", help="prompt kinds (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=1, help="prompts of each kind per context (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the prompt sets' seed (default: %(default)s)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated none | METHOD:K | NAME:K of --heads "
                                                              "(default: %(default)s)")
    p.add_argument("--peagle", type=Path, default=None,
                   help="P-EAGLE head (default TARGET/drafter-peagle, else the shipped SmolLM2 head)")
    p.add_argument("--eagle3", type=Path, default=None,
                   help="EAGLE-3 head (default TARGET/drafter-eagle3, else the shipped SmolLM2 head)")
    p.add_argument("--heads", default="", help="more heads, comma-separated NAME=DIR (configs NAME:K)")
    options(p, target="smollm2", backend="onnxruntime", threads=None, max_tokens=32, rounds=1)


# -- configurations ------------------------------------------------------------------------------------
def head_method(path: Path) -> str:
    """peagle | eagle3: the method a head was trained with (its config.json's training record, else
    whether it names a mask token)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--heads: no readable head config at {path / 'config.json'} ({exc})") from exc
    method = (cfg.get("training") or {}).get("method")  # both kinds share one architecture name
    if method is None:  # a head from elsewhere: P-EAGLE's names its mask token
        from peagle_trt.checkpoint.drafter import mask_token_id

        method = "peagle" if mask_token_id(cfg, str(path)) is not None else "eagle3"
    if method not in ("peagle", "eagle3"):
        raise ConfigError(f"--heads: {path} does not say whether it is a peagle or eagle3 head (training.method)")
    return method


def default_head(args, method: str) -> Path:
    path = getattr(args, method) or next((p for p in (args.target / f"drafter-{method}", SHIPPED_HEADS / method)
                                          if p.is_dir()), None)
    if path is None or not path.is_dir():
        raise ConfigError(f"no {method} head at {path or args.target / f'drafter-{method}'}: pass --{method} DIR")
    return path


def parse_configs(args) -> list[Config]:
    extra = {}
    for item in filter(None, (x.strip() for x in args.heads.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name or ":" in name or name in ("none", "peagle", "eagle3"):
            raise ConfigError(f"--heads: {item!r} is not NAME=DIR (NAME not none, peagle or eagle3)")
        extra[name] = (head_method(Path(path)), Path(path))
    configs = []
    for item in filter(None, (x.strip() for x in args.configs.split(","))):
        name, _, k = item.partition(":")
        if name == "none" and not k:
            configs.append(Config("none", SpecConfig("none", 0), None))
            continue
        if not k.isdigit() or int(k) < 1 or name not in ("peagle", "eagle3", *extra):
            raise ConfigError(f"--configs: {item!r} is not none or NAME:K (NAME peagle, eagle3 or one of --heads)")
        method, path = extra.get(name) or (name, default_head(args, name))
        configs.append(Config(f"{name} K={k}", SpecConfig(method, int(k)), path))
    if not configs or configs[0].spec.mode != "none":
        raise ConfigError("--configs must start with none: speed-ups and mismatches are against it")
    return configs


# -- one request -------------------------------------------------------------------------------------
def one_request(gen, ids: tuple[int, ...], params: SamplingParams) -> dict:
    """Run one prompt (token ids) alone through the generator's scheduler on this thread: its output,
    TTFT (submit to the first token) and the decode time and tokens after it, its spec stats."""
    from peagle_trt.runtime.scheduler import Request

    out: list[int] = []
    marks: dict = {}

    def on_output(o) -> None:
        now = time.perf_counter()
        if o.new_token_ids and "first" not in marks:
            marks["first"], marks["first_tokens"] = now, len(o.new_token_ids)
        out.extend(o.new_token_ids)
        if o.finished:
            marks.update(end=now, stats=o.stats, error=o.error)

    t0 = time.perf_counter()
    gen.scheduler.add(Request("long-context", list(ids), params, on_output))
    while gen.scheduler.has_work:
        gen.scheduler.step()
    if marks.get("error") or "first" not in marks:
        raise RuntimeInvariantError(f"a long-context request failed: {marks.get('error') or 'no token'}")
    stats = marks["stats"].to_dict() if marks.get("stats") is not None else {}
    return {"token_ids": out, "ttft_s": marks["first"] - t0, "decode_s": marks["end"] - marks["first"],
            "decode_tokens": len(out) - marks["first_tokens"], **{k: stats.get(k) for k in
                                                                   ("acceptance_length", "accept_rate_per_pos",
                                                                    "steps")}}


def measure_context(args, configs: list[Config], prompts: list, max_seq_len: int, label: str,
                    turn: int = 0) -> list[dict]:
    """One context: per prompt, every configuration in turn within each round (see the docstring);
    `turn` (the context's index) flips the first order, so single rounds alternate across contexts."""
    params = SamplingParams(max_tokens=args.max_tokens)
    gens = {}
    for c in configs:
        gens[c.name] = generator(args, c, 1, max_seq_len)
        warm = gens[c.name].codec.encode_prompt("Say hello.", gens[c.name].codec.has_chat_template)
        one_request(gens[c.name], tuple(warm), SamplingParams(max_tokens=4))  # sessions, allocations
    runs: dict = {c.name: [[None] * args.rounds for _ in prompts] for c in configs}
    for j, p in enumerate(prompts):
        for r in range(args.rounds):
            order = configs if (r + j + turn) % 2 == 0 else configs[::-1]
            for c in order:
                runs[c.name][j][r] = one_request(gens[c.name], p.ids, params)
            progress(f"[long-context] {label}: prompt {j + 1}/{len(prompts)} ({p.kind}, {p.tokens} tokens), "
                     f"round {r + 1}/{args.rounds}")
    gens.clear()
    gc.collect()
    ref = [runs[configs[0].name][j][0]["token_ids"] for j in range(len(prompts))]
    rows = []
    for c in configs:
        k = c.spec.num_spec_tokens
        per = runs[c.name]
        last = [per[j][-1] for j in range(len(prompts))]
        tps = [sum(per[j][r]["decode_tokens"] for j in range(len(prompts)))
               / max(sum(per[j][r]["decode_s"] for j in range(len(prompts))), 1e-9) for r in range(args.rounds)]
        steps = sum(x["steps"] or 0 for x in last)
        decode_s = statistics.median(sum(per[j][r]["decode_s"] for j in range(len(prompts)))
                                     for r in range(args.rounds))
        rows.append({"context": label, "config": c.name, "method": c.spec.mode, "K": k, **pooled(last, k),
                     "decode_tokens_per_s": round(statistics.median(tps), 2),
                     "decode_tokens_per_s_rounds": [round(t, 2) for t in tps],
                     "ms_per_step": round(1e3 * decode_s / steps, 2) if steps else None,
                     "ttft_s": round(statistics.mean(per[j][0]["ttft_s"] for j in range(len(prompts))), 3),
                     "ttft_s_prompts": [round(per[j][0]["ttft_s"], 3) for j in range(len(prompts))],
                     "mismatches": sum(per[j][r]["token_ids"] != ref[j] for j in range(len(prompts))
                                       for r in range(args.rounds))})
    for row in rows:
        row["speedup"] = round(row["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"], 3)
    return rows


def target_limit(target: Path) -> int:
    """The target's max_position_embeddings (config.json; 4096 when it has none)."""
    with contextlib.suppress(OSError, json.JSONDecodeError):
        return int(json.loads((target / "config.json").read_text()).get("max_position_embeddings", 4096))
    return 4096


def run(args: argparse.Namespace) -> dict:
    from peagle_trt.bench.long_prompts import long_prompts
    from peagle_trt.tokenizer import TextCodec

    if args.rounds < 1 or args.prompts < 1 or args.max_tokens < 1:
        raise ConfigError("--rounds, --prompts and --max-tokens must be >= 1")
    if args.threads and args.backend == "torch":  # onnxruntime takes them through the generator
        import torch

        torch.set_num_threads(args.threads)
    configs = parse_configs(args)
    contexts = sorted(set(int_list(args.contexts)))
    kinds = tuple(k for k in args.kinds.split(",") if k)
    codec = TextCodec(args.target)
    cap = target_limit(args.target) - args.max_tokens - MARGIN
    if not contexts or contexts[0] < 64:
        raise ConfigError(f"--contexts {args.contexts!r}: give context lengths of at least 64 tokens")
    sets = {}
    for ctx in contexts:
        progress(f"[long-context] prompts of {min(ctx, cap)} tokens")
        sets[ctx] = long_prompts(codec, min(ctx, cap), args.prompts, kinds, args.seed)
    rows = []
    with stdout_to_stderr():
        for i, ctx in enumerate(contexts):
            longest = max(p.tokens for p in sets[ctx])
            rows += measure_context(args, configs, sets[ctx], longest + args.max_tokens + MARGIN, ctx_label(ctx), i)
            for r in rows[-len(configs):]:
                r["context_tokens"], r["prompt_tokens"] = ctx, [p.tokens for p in sets[ctx]]
            if args.output_dir is not None:  # a run stopped early keeps its finished contexts
                with open(args.output_dir / "bench_long_context_rows.jsonl", "a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in rows[-len(configs):])
            progress(f"[long-context] {ctx_label(ctx)}: " + ", ".join(
                f"{r['config']} {r['decode_tokens_per_s']} tok/s AL {r['acceptance_length']:.2f}"
                for r in rows[-len(configs):]))
    label = Path(args.target).name
    spec = [r for r in rows if r["method"] != "none"]
    panels = [(f"Acceptance, {label}", "context (prompt tokens)", "acceptance length",
               series(spec, "context_tokens", "acceptance_length", lambda r: r["config"])),
              ("Decode speed-up over none", "context (prompt tokens)", "speed-up",
               series(spec, "context_tokens", "speedup", lambda r: r["config"]))]
    times = [("Decode speed", "context (prompt tokens)", "tokens/s (decode steps)",
              series(rows, "context_tokens", "decode_tokens_per_s", lambda r: r["config"])),
             ("Time to first token", "context (prompt tokens)", "TTFT (s)",
              series(rows, "context_tokens", "ttft_s", lambda r: r["config"]))]
    pngs = [lines(args, "", panels, log2x=True), lines(args, "time", times, log2x=True)]
    header = ["context", "prompt tokens", "config", "AL", "per-position", "decode tok/s", "speed-up", "ms/step",
              "TTFT s", "mismatches"]
    body = [[r["context"], " ".join(map(str, r["prompt_tokens"])), r["config"], r["acceptance_length"],
             " ".join(f"{x:.2f}" for x in r["accept_rate_per_pos"]), r["decode_tokens_per_s"], r["speedup"],
             r["ms_per_step"], r["ttft_s"], r["mismatches"]] for r in rows]
    sets_json = {ctx_label(c): [{"kind": p.kind, "tokens": p.tokens, "parts": list(p.parts), "request": p.request}
                                for p in ps] for c, ps in sets.items()}
    return finish(args, f"{label}: long contexts, none vs EAGLE-3 vs P-EAGLE ({args.backend}, batch 1)", [
        f"Contexts {', '.join(ctx_label(c) for c in contexts)} (capped at {cap} tokens: the target's positions - "
        f"{args.max_tokens} new tokens - {MARGIN}); {args.prompts} prompt(s) of each kind ({', '.join(kinds)}) per "
        f"context; greedy, {args.max_tokens} new tokens at most; {args.rounds} rounds, configurations alternated; "
        "TTFT from the cold first round (mean over prompts), decode tok/s the median over rounds.",
        table(header, body, 2), *pngs],
        {"contexts": contexts, "cap": cap, "rows": rows, "prompts": sets_json,
         "heads": {c.name: str(c.head) for c in configs if c.head}}, figures(rows, contexts, label))


def ctx_label(ctx: int) -> str:
    return f"{ctx // 1024}K" if ctx >= 1024 and ctx % 1024 == 0 else str(ctx)


def figures(rows: list[dict], contexts: list[int], label: str) -> list[Figure]:
    """The headline figures: P-EAGLE's AL (its largest K) and speed-up (its fastest K at the longest
    context) at the longest context over the shortest, and the target alone's decode tok/s likewise."""
    if len(contexts) < 2:
        return []
    lo, hi = ctx_label(contexts[0]), ctx_label(contexts[-1])
    at = {(r["context"], r["config"]): r for r in rows}
    peagle = [r for r in rows if r["method"] == "peagle" and r["config"].startswith("peagle ")]
    out = []
    if peagle:
        k_al = max(r["K"] for r in peagle)
        fast = max((r for r in peagle if r["context"] == hi), key=lambda r: r["decode_tokens_per_s"])["config"]
        al = f"peagle K={k_al}"
        out += [Figure(f"{label} long context: P-EAGLE ({al}) AL at {hi} over at {lo}",
                       at[hi, al]["acceptance_length"] / at[lo, al]["acceptance_length"], "x", "", 2),
                Figure(f"{label} long context: P-EAGLE ({fast}) decode speed-up over none, at {hi} over at {lo}",
                       at[hi, fast]["speedup"] / at[lo, fast]["speedup"], "x", "", 2)]
    out.append(Figure(f"{label} long context: target alone decode tok/s at {hi} over at {lo}",
                      at[hi, "none"]["decode_tokens_per_s"] / at[lo, "none"]["decode_tokens_per_s"], "x", "", 2))
    return out


def refigure(results: dict) -> list[Figure]:
    """The figures of a saved run (`peagle-trt bench report --record-run`), from its rows."""
    return figures(results["rows"], results["contexts"], Path(results["options"]["target"]).name)
