#!/usr/bin/env python3
"""Acceptance of the trained code pair on held-out standard-library prompts (in-distribution), in-process.

What: the prompts scripts/make_code_pair.py makes (a stdlib function's `def` line and first-line
docstring), taking the ones AFTER the 192 the heads were trained on (and, with --exclude, not among the
prompts of a retrained head); greedy, --max-tokens tokens,
P-EAGLE at K = 1, 3, 5, 7, 10 and EAGLE-3 at K = 1, 3, 5, 7. Run in-process with the speculative
decoder the served model uses (`SpecDecoder` over `TorchExecutor`): greedy acceptance does not
depend on the serving path. Why: next to HumanEval (scripts/bench_acceptance.py), it separates
how well the heads learned the target from how far HumanEval is from their training prompts.

    .venv/bin/python scripts/bench_acceptance_stdlib.py            # ~2 minutes; JSON last line
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from peagle_trt.checkpoint import load_pair
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.runtime.executor import TorchExecutor
from peagle_trt.speculative.decoder import SpecDecoder
from peagle_trt.runtime.scheduler import generate
from peagle_trt.speculative.stats import SpecStats
from peagle_trt.tokenizer import TextCodec

sys.path.insert(0, str(Path(__file__).parent))
from make_code_pair import function_prompts  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pair", type=Path, default=Path("tests/fixtures/code-pair"))
    p.add_argument("--trained", type=int, default=192, help="prompts the heads were trained on (skipped)")
    p.add_argument("--exclude", type=Path, action="append", default=[],
                   help="JSONL of further training prompts (make_code_pair's work dir): functions in it are skipped")
    p.add_argument("--methods", default="peagle,eagle3", help="heads to measure (comma-separated)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    seen = {json.loads(line)["prompt"].splitlines()[0] for f in args.exclude for line in f.open() if line.strip()}
    pool = function_prompts(10 ** 6, 0)[args.trained:]
    prompts = [x for x in pool if x.splitlines()[0] not in seen][:args.prompts]  # by `def` line
    codec = TextCodec(args.pair)
    ids = [codec.encode_prompt(x, chat_template=False) for x in prompts]
    params = SamplingParams(max_tokens=args.max_tokens)
    rows = []
    heads = (("peagle", (1, 3, 5, 7, 10)), ("eagle3", (1, 3, 5, 7)))
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
            print(f"{method:7s} K={k:2d} AL {total.acceptance_length:.2f} per-pos "
                  + " ".join(f"{x:.2f}" for x in total.accept_rate_per_pos), flush=True)
    print(json.dumps({"dataset": f"stdlib held-out prompts from {args.trained}, {len(seen)} functions excluded",
                      "n_prompts": len(prompts), "max_tokens": args.max_tokens, "rows": rows}))


if __name__ == "__main__":
    main()
