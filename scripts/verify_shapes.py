"""What a verify costs by its shape: B requests x R rows each, one target forward on onnxruntime at a
given context length. The measurement behind the per-batch-size costs of adaptive K
(peagle_trt/speculative/draft_length.py; docs/BENCHMARKS.md, "Speculation controls").

    python scripts/verify_shapes.py [--target DIR] [--context 300] [--reps 25]   # ~2 min, JSON last line

Every shape with B in 1, 2, 4, 8 and R in 1, 2, 3, 4, 8 (B x R <= 32) runs once per repetition, in a
new random order each time (the first 3 repetitions are warm-up); the figure is the median ms.
Each request has its own blocks of the paged cache and its rows sit at positions context ..
context + R - 1, so each reads `context` positions of KV (zeros here: the cost, not the values).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target dir (default: the cached SmolLM2)")
    p.add_argument("--context", type=int, default=300, help="positions each request has before its rows")
    p.add_argument("--reps", type=int, default=25, help="repetitions of every shape (3 of them warm-up)")
    args = p.parse_args()

    from peagle_trt.checkpoint import load_pair
    from peagle_trt.config import KVLayout, SpecConfig
    from peagle_trt.executors.onnxruntime import OrtExecutor

    if args.target is None:
        from peagle_trt.convert.packaged import cached_target

        args.target = cached_target("smollm2")
    target, _ = load_pair(args.target, None, SpecConfig("none", 0)).build()
    kv = KVLayout.for_sequences(8, args.context + 64)
    ex = OrtExecutor.from_models(target, None, None, kv=kv)
    m = kv.max_blocks

    def tables(b: int) -> torch.Tensor:  # [1, B, M]: request i holds blocks i*M .. i*M + M - 1
        return torch.arange(b * m).view(1, b, m)

    shapes = [(b, r) for b in (1, 2, 4, 8) for r in (1, 2, 3, 4, 8) if b * r <= 32]
    ms: dict = {s: [] for s in shapes}
    rng = random.Random(0)
    for rep in range(args.reps):
        rng.shuffle(shapes)
        for b, r in shapes:
            tokens = torch.randint(0, 1000, (b, r))
            positions = (args.context + torch.arange(r)).expand(b, -1).contiguous()
            t0 = time.perf_counter()
            ex.target(tokens, positions, tables(b))
            if rep >= 3:
                ms[(b, r)].append((time.perf_counter() - t0) * 1e3)
    rows = [{"requests": b, "rows_per_request": r, "rows": b * r, "ms": round(statistics.median(v), 2)}
            for (b, r), v in sorted(ms.items())]
    print("| requests | rows each | rows | ms |\n|---|---|---|---|")
    for x in rows:
        print(f"| {x['requests']} | {x['rows_per_request']} | {x['rows']} | {x['ms']} |")
    print(json.dumps({"script": "verify_shapes", "target": str(args.target), "context": args.context,
                      "reps": args.reps, "shapes": rows}))


if __name__ == "__main__":
    main()
