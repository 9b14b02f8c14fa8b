"""What deterministic mode costs on SmolLM2-135M (float32 target forwards on CPU): the measurement
behind docs/BENCHMARKS.md "Deterministic mode: cost".

    python scripts/deterministic_cost.py [--rounds 3] [--reps 5] [--context 128]   # ~3 min, JSON last line

Contenders: the torch and onnxruntime executors, each plain and deterministic (executors/torch.py,
executors/onnxruntime.py), over the same weights, and plain torch on one thread (deterministic mode
runs torch on one thread: this separates the cost of its fixed row blocks and row-wise attention
from the cost of the thread count). Shapes: decode (1 row per request) and verify
(K + 1 = 4 rows per request) at batch 1 and 8, each request at `--context` cached positions.
Each round times `--reps` forwards of every (contender, shape), the contenders alternated within
the round (their order reversed every other round); figures are medians over all rounds, in ms.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--context", type=int, default=128)
    args = p.parse_args()

    from peagle_trt.checkpoint import load_pair
    from peagle_trt.config import KVLayout, SpecConfig
    from peagle_trt.convert.packaged import cached_target
    from peagle_trt.executors.onnxruntime import OrtExecutor
    from peagle_trt.executors.torch import TorchExecutor

    target, _ = load_pair(cached_target("smollm2"), None, SpecConfig("none", 1)).build()
    kv = KVLayout.for_sequences(8, args.context + 8, max_rows=args.context)
    plain = TorchExecutor(target, None, kv)
    contenders = {
        "torch": plain,
        "torch 1 thread": plain,
        "torch deterministic": TorchExecutor(target, None, kv, deterministic=True),
        "onnxruntime": OrtExecutor.from_models(target, None, None, kv),
        "onnxruntime deterministic": OrtExecutor.from_models(target, None, None, kv, deterministic=True),
    }
    gen = torch.Generator().manual_seed(0)
    m = kv.max_blocks
    tables = torch.arange(8 * m).view(1, 8, m)  # request b holds blocks b*m .. b*m + m - 1
    prompt = torch.randint(0, 49152, (8, args.context), generator=gen)
    for ex in {id(ex): ex for ex in contenders.values()}.values():  # the context of every request, once
        ex.target(prompt, torch.arange(args.context).expand(8, -1).contiguous(), tables)
    shapes = {f"{kind} batch {b}": (b, rows) for kind, rows in (("decode", 1), ("verify", 4)) for b in (1, 8)}
    times = {(c, s): [] for c in contenders for s in shapes}
    for r in range(args.rounds):
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for shape, (b, rows) in shapes.items():
            tokens = torch.randint(0, 49152, (b, rows), generator=gen)
            positions = (args.context + torch.arange(rows)).expand(b, -1).contiguous()
            for name in order:
                ex, threads = contenders[name], torch.get_num_threads()
                if name == "torch 1 thread":
                    torch.set_num_threads(1)
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    ex.target(tokens, positions, tables[:, :b])
                    times[name, shape].append(1000 * (time.perf_counter() - t0))
                torch.set_num_threads(threads)
    table = {shape: {c: round(statistics.median(times[c, shape]), 1) for c in contenders} for shape in shapes}
    for shape, row in table.items():
        print(f"{shape:16s} " + "  ".join(f"{c}: {ms:7.1f} ms" for c, ms in row.items()))
    print(json.dumps({"ms_median": table, "rounds": args.rounds, "reps": args.reps, "context": args.context,
                      "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}))


if __name__ == "__main__":
    main()
