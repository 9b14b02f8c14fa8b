"""Suite `context-decode` (docs/BENCHMARKS.md, "context-decode"): how a step's time grows with the context. A
real target (default the cached SmolLM2-135M, float32) on this CPU, batch 1, on both backends (torch reference
ops, onnxruntime graphs), one process, every contender alternated: at each of --contexts cached positions, one
decode forward (1 row: the time per decoded token, prefill excluded), one verify forward of 1 + K rows and one
P-EAGLE drafter pass (a random-weight head of the target's shape: --pending rows + K - 1 mask rows over its own
KV cache); medians in ms and each one's ratio to the same forward at the first context.

    peagle-trt bench context-decode [--target smollm2] [--contexts 512,2048,4096,8192] [--rounds 7]
                                    [--backends onnxruntime | torch]

One backend per process for figures (the default: onnxruntime, the CPU default): in a process that also
runs onnxruntime, torch's OpenMP threads wait on onnxruntime's spinning pool. The cached positions are never
written (their K/V are zeros): attention reads them all the same, so the time is the time of a real context
of that length. The headline figures: decode at the last context over the first, per backend.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from peagle_trt.bench.forwards import forward
from peagle_trt.bench.harness import Figure, alternate, finish, int_list, machine, options, progress, records

BACKENDS = ("torch", "onnxruntime")
SMOKE = dict(contexts="16,64", rounds=2, spec_tokens=3, pending=2, backends=",".join(BACKENDS))


def add_arguments(p: argparse.ArgumentParser) -> None:
    options(p, target="smollm2", threads=2, rounds=7)
    p.add_argument("--contexts", default="512,2048,4096,8192",
                   help="comma-separated cached positions before the timed rows (default: %(default)s)")
    p.add_argument("--backends", default="onnxruntime",
                   help=f"comma-separated, from {','.join(BACKENDS)} (default: %(default)s)")
    p.add_argument("--spec-tokens", type=int, default=3, help="K: verify rows 1 + K, drafter mask rows K - 1 "
                   "(default: %(default)s; 0: no verify, no drafter)")
    p.add_argument("--pending", type=int, default=2, help="the drafter pass's pending rows (default: %(default)s)")


def random_head(target, k: int):
    """A P-EAGLE head (one layer) of the target's widths with random float32 weights: its forward costs what a
    trained one's does."""
    from peagle_trt.architecture import DrafterConfig
    from peagle_trt.models.drafter import DrafterModel
    from peagle_trt.models.rope import inv_freq

    torch.manual_seed(0)
    t = target.config
    c = DrafterConfig(layout="aws", hidden_size=t.hidden_size, num_layers=1, num_heads=t.num_heads,
                      num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, intermediate_size=t.intermediate_size,
                      rms_norm_eps=t.rms_norm_eps, rope=t.rope, vocab_size=t.vocab_size,
                      draft_vocab_size=min(t.vocab_size, 32000), target_hidden_size=t.hidden_size,
                      mask_token_id=t.vocab_size - 1, has_mask_hidden=True)
    head = DrafterModel(c).float().eval().requires_grad_(False)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
        head.inv_freq = inv_freq(c.rope, c.head_dim)[0]
        head.mask_hidden = torch.randn(1, 1, c.num_aux * c.target_hidden_size) * 0.02
        head.h_mask = head.project(head.mask_hidden).reshape(-1)
    return head


def executors(target, head, k: int, max_len: int, threads: int, backends: list[str]) -> dict:
    """backend -> an executor (target and `head` when k > 0) with room for one request of `max_len` positions."""
    from peagle_trt.config import KVLayout, SpecConfig
    from peagle_trt.executors.onnxruntime import OrtExecutor
    from peagle_trt.executors.torch import TorchExecutor

    kv = KVLayout.for_sequences(1, max_len)
    spec = SpecConfig("peagle", k) if k else None
    out = {}
    for b in backends:
        out[b] = (TorchExecutor(target, head, kv) if b == "torch" else
                  OrtExecutor.from_models(target, head, spec, kv, threads=threads))
    return out


def draft_pass(ex, context: int, pending: int, k: int, aux_width: int):
    """One P-EAGLE drafter pass of `ex`: `pending` rows ending at position context - 1, then k - 1 mask rows."""
    tokens = torch.randint(0, 100, (1, pending))
    aux = torch.randn(1, pending, aux_width) * 0.1
    num, cur = torch.tensor([pending]), torch.tensor([context])
    tables = torch.arange(ex.kv.max_blocks).view(1, 1, -1).expand(len(ex.windows), -1, -1).contiguous()
    return lambda: ex.draft_parallel(tokens, aux, num, cur, tables, k)


def run(args: argparse.Namespace) -> dict:
    from peagle_trt.checkpoint import load_pair
    from peagle_trt.config import SpecConfig
    from peagle_trt.errors import ConfigError

    torch.set_num_threads(args.threads)
    contexts, backends, k = int_list(args.contexts), [b for b in args.backends.split(",") if b], args.spec_tokens
    if not contexts or set(backends) - set(BACKENDS) or not backends or k < 0 or args.pending < 1:
        raise ConfigError(f"--contexts must list positions, --backends come from {BACKENDS}, --spec-tokens >= 0, "
                          f"--pending >= 1 (got {args.contexts!r}, {args.backends!r}, {k}, {args.pending})")
    mach = machine(args.smoke)
    target, _ = load_pair(args.target, None, SpecConfig("none", 0)).build()
    head = random_head(target, k) if k else None
    progress(f"[context-decode] executors for {max(contexts)} positions: {', '.join(backends)}")
    exs = executors(target, head, k, max(contexts) + k + 1, args.threads, backends)
    kinds = {"decode": 1} | ({f"verify {1 + k} rows": 1 + k, "drafter": 0} if k else {})
    calls, aux_width = {}, head.config.num_aux * target.config.hidden_size if k else 0
    for b, ex in exs.items():
        for c in contexts:
            for kind, rows in kinds.items():
                calls[b, c, kind] = forward(ex, 1, rows, c) if rows else draft_pass(ex, c, args.pending, k, aux_width)
    progress(f"[context-decode] {len(calls)} contenders, {args.rounds} rounds")
    times = alternate(calls, args.rounds)
    ms = {key: 1e3 * statistics.median(t) for key, t in times.items()}
    rows = []
    for b in backends:
        for kind in kinds:
            base = ms[b, contexts[0], kind]
            rows.append({"backend": b, "forward": kind,
                         **{f"{c} ms": round(ms[b, c, kind], 2) for c in contexts},
                         f"{contexts[-1]}/{contexts[0]}": round(ms[b, contexts[-1], kind] / base, 3)})
    ratio = f"{contexts[-1]}/{contexts[0]}"
    figures = [Figure(f"{args.target.name} decode, batch 1, {b}: ms per token at "
                      f"{contexts[-1]} cached positions over {contexts[0]}", r[ratio], "x", "<= 1.5x", 2)
               for b in backends for r in rows if r["backend"] == b and r["forward"] == "decode"]
    return finish(args, f"One forward by context, batch 1 ({args.target.name}, float32, {args.threads} threads; "
                  f"medians of {args.rounds} alternated rounds, ms)",
                  [records(rows, list(rows[0]), 2)],
                  {"rounds": args.rounds, "contexts": contexts, "spec_tokens": k, "pending": args.pending,
                   "rows": rows, "ms": {f"{b}/{c}/{kind}": round(v, 3) for (b, c, kind), v in ms.items()}},
                  figures, mach)
