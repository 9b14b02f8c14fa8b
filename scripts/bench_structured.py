"""Structured output with speculation, measured: one prompt at batch 1 through the scheduler
(`generate`), free vs constrained by a JSON schema (or a regex), speculation vs none, contenders
alternated round by round in one process. Prints one JSON line per run and a summary: tokens/s,
acceptance length, the grammar's share of a decode step (fill the bitmasks + apply them), the
masks of one step at batch 8 x (K + 1) rows, and the compile time of the schema (cold: the
tokenizer's tables included; cached). One warm-up run per contender first.

    python scripts/bench_structured.py --target DIR --drafter DIR [--schema FILE | --regex R]
        [--prompt TEXT] [--raw] [--k 3] [--max-tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from peagle_trt.checkpoint import load_pair
from peagle_trt.checkpoint.target import load_target_config
from peagle_trt.config import SamplingParams, SpecConfig, StructuredOutput
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.runtime.scheduler import generate
from peagle_trt.speculative import decoder as decoder_mod
from peagle_trt.speculative.decoder import SpecDecoder
from peagle_trt.speculative.grammar import Grammars
from peagle_trt.tokenizer import TextCodec


class Timed:
    """Wraps a function of decoder.py and sums its time."""

    def __init__(self, name: str):
        self.name, self.inner, self.total = name, getattr(decoder_mod, name), 0.0
        setattr(decoder_mod, name, self)

    def __call__(self, *args):
        t0 = time.perf_counter()
        try:
            return self.inner(*args)
        finally:
            self.total += time.perf_counter() - t0


def batch_masks(compiled, codec, k: int, batch: int = 8, repeats: int = 20) -> dict:
    """Median time of one verify step's masks at `batch` constrained requests x (k + 1) rows, from
    the grammar's start (each request's drafts: the first k tokens of '{"'... as far as valid)."""
    import torch

    from peagle_trt.speculative.grammar import GrammarState, _xgr

    vocab = compiled.tokenizer_info.vocab_size
    states = [GrammarState(compiled, frozenset(codec.eos_ids)) for _ in range(batch)]
    drafts = codec.tok.encode('{"city": "Paris", "unit": "celsius"}', add_special_tokens=False)[:k]
    logits = torch.randn(batch, k + 1, vocab)
    fill, apply = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        bitmask = _xgr().allocate_token_bitmask(batch * (k + 1), vocab)
        for i, state in enumerate(states):
            state.fill(drafts, bitmask, i * (k + 1))
        t1 = time.perf_counter()
        decoder_mod.apply_masks(logits, bitmask.view(batch, k + 1, -1))
        fill.append(t1 - t0)
        apply.append(time.perf_counter() - t1)
    return {"batch": batch, "rows": batch * (k + 1), "fill_ms": round(1e3 * statistics.median(fill), 3),
            "apply_ms": round(1e3 * statistics.median(apply), 3)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--drafter", type=Path, required=True)
    p.add_argument("--schema", type=Path)
    p.add_argument("--regex")
    p.add_argument("--prompt", default="What is the weather in Paris? Answer with get_weather's arguments as JSON.")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--mode", default="peagle")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--raw", action="store_true", help="send the prompt as raw text (no chat template)")
    args = p.parse_args()
    codec = TextCodec(args.target)
    structured = StructuredOutput.from_dict({"json": json.loads(args.schema.read_text())} if args.schema
                                            else {"regex": args.regex})
    grammars = Grammars(codec.tok, load_target_config(args.target).vocab_size)
    t0 = time.perf_counter()
    grammars.compile(structured).result()
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammars.compile(structured).result()
    cached = time.perf_counter() - t0
    other = StructuredOutput.from_dict({"json": {"type": "object", "properties": {"x": {"type": "integer"}}}})
    t0 = time.perf_counter()
    grammars.compile(other).result()  # a second schema: the tokenizer's tables are made
    warm = time.perf_counter() - t0
    print(json.dumps({"compile_cold_s": round(cold, 4), "compile_cached_s": round(cached, 6),
                      "compile_second_schema_s": round(warm, 4)}))
    print(json.dumps(batch_masks(grammars.compile(structured).result(), codec, args.k)))
    decoders = {}
    for mode in ("none", args.mode):
        spec = SpecConfig(mode, args.k)
        target, drafter = load_pair(args.target, args.drafter if mode != "none" else None, spec).build()
        decoders[mode] = SpecDecoder(TorchExecutor(target, drafter, 1, 1024), spec, codec.eos_ids)
    prompt = codec.encode_prompt(args.prompt, chat_template=not args.raw)
    fill, apply = Timed("verify_masks"), Timed("apply_masks")
    for dec in decoders.values():  # warm-up (first-call costs), not measured
        for s in (None, structured):
            generate(dec, prompt, SamplingParams(max_tokens=8, structured=s), grammars=grammars)
    rows: dict = {}
    for _ in range(args.rounds):
        for mode, dec in decoders.items():
            for name, s in (("free", None), ("schema", structured)):
                fill.total = apply.total = 0.0
                step_time = [0.0]
                inner = dec.step

                def timed_step(seqs, inner=inner, acc=step_time):
                    t = time.perf_counter()
                    inner(seqs)
                    acc[0] += time.perf_counter() - t

                dec.step = timed_step
                t0 = time.perf_counter()
                seq = generate(dec, prompt, SamplingParams(max_tokens=args.max_tokens, structured=s), grammars=grammars)
                wall = time.perf_counter() - t0
                del dec.step
                masking, steps = fill.total + apply.total, max(seq.stats.target_forwards - 1, 1)  # - the prefill
                row = {"mode": mode, "output": name, "tokens": len(seq.output), "finish": seq.finish_reason,
                       "tokens_per_s": round(len(seq.output) / wall, 2), "al": round(seq.stats.acceptance_length, 3),
                       "steps": seq.stats.target_forwards, "mask_share_of_step": round(masking / step_time[0], 4),
                       "mask_ms_per_step": round(1e3 * masking / steps, 3)}
                print(json.dumps(row), flush=True)
                rows.setdefault((mode, name), []).append(row)
    for (mode, name), rs in rows.items():
        print(f"{mode:7s} {name:6s} tokens/s {statistics.median(r['tokens_per_s'] for r in rs):7.2f}  "
              f"AL {rs[0]['al']:.2f}  tokens {rs[0]['tokens']} ({rs[0]['finish']})  "
              f"mask {statistics.median(r['mask_ms_per_step'] for r in rs):.3f} ms/step "
              f"({100 * statistics.median(r['mask_share_of_step'] for r in rs):.1f}% of a step)")
    grammars.close()


if __name__ == "__main__":
    main()
