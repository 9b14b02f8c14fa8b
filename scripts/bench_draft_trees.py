"""Draft trees vs chains on the trained code pair (tests/data/code-pair), batch 1, greedy,
onnxruntime (graphs made in memory), HumanEval prompts: acceptance length, tokens/s, and where the
accepted path left the top-1 chain (depth), configurations alternated per prompt.

    python scripts/bench_draft_trees.py --prompts 4 --max-tokens 96 --rounds 3

Prints one JSON line per configuration and whether every output equals every other (it must:
greedy speculation is the target's own output). docs/BENCHMARKS.md, "Draft trees".
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

from peagle_trt.bench.prompts import humaneval_prompts
from peagle_trt.checkpoint import load_pair
from peagle_trt.config import KVLayout, SamplingParams, SpecConfig
from peagle_trt.demo import code_pair
from peagle_trt.executors.onnxruntime import OrtExecutor
from peagle_trt.runtime.scheduler import generate
from peagle_trt.speculative import decoder as decoder_module
from peagle_trt.speculative.decoder import SpecDecoder
from peagle_trt.tokenizer import TextCodec

CONFIGS = {"none": SpecConfig("none", 0), "chain-4": SpecConfig("peagle", 4), "chain-7": SpecConfig("peagle", 7),
           "tree-8": SpecConfig("peagle", 7, tree_budget=8), "tree-16": SpecConfig("peagle", 7, tree_budget=16),
           "tree-32": SpecConfig("peagle", 7, tree_budget=32)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    pair = code_pair()
    codec = TextCodec(pair)
    prompts = [codec.encode_prompt(p["prompt"], chat_template=False) for p in humaneval_prompts()[:a.prompts]]
    target, drafter = load_pair(pair, pair / "drafter-peagle", SpecConfig("peagle", 7)).build()
    decoders = {name: SpecDecoder(OrtExecutor.from_models(target, drafter if spec.k else None, spec,
                                                           KVLayout.for_sequences(1, 1024)), spec)
                for name, spec in CONFIGS.items()}
    left = Counter()  # (config, depth at which the accepted path left the top-1 chain)
    walk, running = decoder_module.walk, [""]

    def counting_walk(tokens, parents, choose):
        path, emitted = walk(tokens, parents, choose)
        node = -1
        for depth, n in enumerate(path, 1):
            if n != next(i for i, p in enumerate(parents) if p == node):  # not the first (top-1) child
                left[running[0], depth] += 1
                break
            node = n
        return path, emitted

    decoder_module.walk = counting_walk
    rows = {name: Counter() for name in CONFIGS}
    outputs: dict = {}
    for r in range(a.rounds):
        for i, prompt in enumerate(prompts):  # every configuration in turn, the order reversed every other time
            for name in (list(CONFIGS) if (r + i) % 2 == 0 else list(CONFIGS)[::-1]):
                running[0] = name
                t0 = time.perf_counter()
                seq = generate(decoders[name], prompt, SamplingParams(max_tokens=a.max_tokens, ignore_eos=True))
                row = rows[name]
                row["seconds"] += time.perf_counter() - t0
                row["tokens"] += len(seq.output)
                row["steps"] += seq.stats.steps
                row["accepted"] += seq.stats.accepted
                row["nodes"] += seq.stats.drafted
                outputs.setdefault(i, set()).add(tuple(seq.output))
    for name, row in rows.items():
        steps = row["steps"] or 1
        print(json.dumps({"config": name, "acceptance_length": round(1 + row["accepted"] / steps, 3),
                          "tokens_per_s": round(row["tokens"] / row["seconds"], 1),
                          "nodes_per_step": round(row["nodes"] / steps, 1), "steps": row["steps"],
                          "left_the_chain_at_depth": {d: n for (c, d), n in sorted(left.items()) if c == name}}))
    print(json.dumps({"outputs_identical": all(len(v) == 1 for v in outputs.values())}))


if __name__ == "__main__":
    main()
