"""Suite `structured` (docs/BENCHMARKS.md, "structured"): structured output under speculation, in
process on CPU (peagle_trt/bench/measure.py, torch executor): --batch copies of one prompt, free vs constrained by
a regex (--regex; default: indented code lines) or a JSON schema (--schema FILE), none vs --mode at
--k, and constrained with the drafts unmasked (`draft_candidates` 1: the top-1 chain, cut where the
grammar refuses it), passes alternated within --rounds. Per cell: tokens/s, acceptance length,
speed-up over none, mismatches with none, ms per step and the grammar's share of it. Beside it: the
grammar's compile time (cold, cached, a second schema) and the masks of one verify step at batch 8.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from unittest import mock

from peagle_trt.bench.harness import Figure, alternate, finish, int_list, options, records, summary, timed

CODE_LINES = r"\n( {4,8}[^\n]{0,60}\n){1,4}"
CODE_PROMPT = 'def is_empty(self):\n    """Return True if the queue is empty."""'
SMOKE = dict(max_tokens=8, rounds=1, batch="1")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", type=Path, default=None, help="drafter head (default: TARGET/drafter-MODE)")
    p.add_argument("--schema", type=Path, default=None, help="a JSON schema file (instead of --regex)")
    p.add_argument("--regex", default=CODE_LINES, help="the regex the output must match (default: code lines)")
    p.add_argument("--prompt", default=CODE_PROMPT, help="the prompt (default: a method of a code queue)")
    p.add_argument("--chat", action="store_true", help="send the prompt through the chat template (default: raw)")
    p.add_argument("--mode", default="peagle", choices=["peagle", "eagle3"], help="the drafter's method")
    p.add_argument("--k", type=int, default=5, help="draft tokens per step")
    options(p, target="code-pair", batch="1", max_tokens=64, rounds=3)


def grammar_costs(args, codec, structured, repeats: int) -> dict:
    """Compile seconds (cold, cached, a second schema) and the ms of one verify step's masks at batch 8
    x (k + 1) rows from the grammar's start (drafts: the first k tokens of a sample, as far as valid)."""
    import torch

    from peagle_trt.checkpoint.target import load_target_config
    from peagle_trt.config import StructuredOutput
    from peagle_trt.speculative.grammar import Grammars, GrammarState, _xgr, apply_masks

    grammars = Grammars(codec.tok, load_target_config(args.target).vocab_size)
    try:
        cold = timed(lambda: grammars.compile(structured).result())
        cached = timed(lambda: grammars.compile(structured).result())
        other = StructuredOutput.from_dict({"json": {"type": "object", "properties": {"x": {"type": "integer"}}}})
        second = timed(lambda: grammars.compile(other).result())
        compiled = grammars.compile(structured).result()
    finally:
        grammars.close()
    b, rows, vocab = 8, args.k + 1, compiled.tokenizer_info.vocab_size
    states = [GrammarState(compiled, frozenset(codec.eos_ids)) for _ in range(b)]
    sample = '{"city": "Paris", "unit": "celsius"}' if args.schema else "\n        return not self.items\n"
    drafts = codec.tok.encode(sample, add_special_tokens=False)[:args.k]
    logits, mask = torch.randn(b, rows, vocab), [_xgr().allocate_token_bitmask(b * rows, vocab)]

    def fill():
        mask[0] = _xgr().allocate_token_bitmask(b * rows, vocab)
        for i, state in enumerate(states):
            state.fill(drafts, mask[0], i * rows)

    t = alternate({"fill": fill, "apply": lambda: apply_masks(logits, mask[0].view(b, rows, -1))}, repeats)
    return {"compile_cold_s": round(cold, 4), "compile_cached_s": round(cached, 6),
            "compile_second_schema_s": round(second, 5), "masks_b8_rows": b * rows,
            **{f"masks_b8_{n}_ms": round(summary(t[n], 1e3)["median"], 3) for n in t}}


def run(args: argparse.Namespace) -> dict:
    from peagle_trt.bench.measure import Config, head, measure, timing
    from peagle_trt.config import SamplingParams, SpecConfig, StructuredOutput
    from peagle_trt.speculative.grammar import GrammarState
    from peagle_trt.tokenizer import TextCodec

    args.backend, drafter = "torch", head(args, args.mode, args.drafter)
    kind = "JSON schema" if args.schema else "regex"
    structured = StructuredOutput.from_dict({"json": json.loads(args.schema.read_text())} if args.schema
                                            else {"regex": args.regex})
    codec = TextCodec(args.target)
    costs = grammar_costs(args, codec, structured, 3 if args.smoke else 20)
    spec = f"{args.mode} K={args.k}"
    unmasked = f"{spec}, drafts unmasked"
    configs = [Config("none", SpecConfig("none", 0), None), Config(spec, SpecConfig(args.mode, args.k), drafter),
               Config(unmasked, SpecConfig(args.mode, args.k), drafter)]

    def around(name: str):  # the unmasked configuration drafts the drafter's top-1 chain
        from peagle_trt.speculative.decoder import SpecDecoder

        return mock.patch.object(SpecDecoder, "draft_candidates", 1) if name == unmasked else contextlib.nullcontext()
    params = {"free": SamplingParams(max_tokens=args.max_tokens),
              kind: SamplingParams(max_tokens=args.max_tokens, structured=structured)}
    max_seq_len = len(codec.encode_prompt(args.prompt, chat_template=args.chat)) + args.max_tokens + 2 * args.k + 16
    rows, bucket = [], {}
    with timing(bucket, GrammarState, ("draft", "pick", "take", "advance"), key="masks"):  # drafts, verify, commit
        for b in int_list(args.batch):
            rows += measure(args, configs, {w: [args.prompt] * b for w in params}, [b], max_seq_len, args.chat,
                            timers=bucket, params=params, around=around)
    for r in rows:
        r.setdefault("masks_ms", 0.0)
        r["masks_share"] = round(r["masks_ms"] / r["ms_per_step"], 4) if r["ms_per_step"] else None
    where = f"{args.target.name}, {kind}"
    head = next(r for r in rows if r["workload"] == kind and r["config"] == spec)
    figures = [Figure(f"structured output ({where}), batch {head['batch']}: {spec} over none", head["speedup"], "x"),
               Figure(f"structured output ({where}): {spec} acceptance length", head["acceptance_length"], ""),
               Figure(f"structured output ({where}): masks per decode step, {spec}, batch {head['batch']}",
                      head["masks_ms"], "ms"),
               Figure(f"structured output ({where}): compile, cold (tokenizer tables included)",
                      costs["compile_cold_s"], "s")]
    return finish(args, f"Structured output under speculation ({where}), medians of {args.rounds} rounds", [
        records(rows, ["batch", "config", "workload", "tokens", "tokens_per_s", "acceptance_length", "speedup",
                       "mismatches", "ms_per_step", "masks_ms", "masks_share"]),
        "Grammar costs: compile (cold: the tokenizer's tables included; cached; a second schema), seconds; the "
        "masks of one verify step at batch 8 x (K + 1) rows, ms", records([costs], list(costs), 6)],
        {"drafter": str(drafter), "grammar": kind, "rows": rows, **costs}, figures)
