"""Suite `drafter` (docs/BENCHMARKS.md, "Drafter forward"): one drafting step of the drafter head: P-EAGLE
parallel vs EAGLE-3 sequential, on CPU.

What: the wall time of the drafter forwards that produce K draft tokens for one sequence
(batch 1) in the middle of a decode, for K = 1, 3, 7, 11 by default.
  parallel    (P-EAGLE, speculative/drafting.py ParallelDrafter -> TorchExecutor.draft_parallel): ONE
              forward over the n pending rows plus K-1 mask rows (token = mask_token_id,
              hidden = h_mask), the lm_head on the K sampled rows only, argmax + d2t.
  sequential  (EAGLE-3, SequentialDrafter): K forwards; the first over the n pending rows (lm_head
              on all n), then K-1 forwards of one row each (previous draft + its pre-norm output).
Both run through the real drafting classes and TorchExecutor's drafting methods (fc projection of
the pending target taps, row assembly, forwards, argmax, d2t), on an executor holding only the
drafter (no target model is needed to draft).

Why: P-EAGLE's claim is that drafting cost stays nearly flat in K (one forward whose row count
grows by K-1), while EAGLE-3's cost grows about K-fold. This measures both on the reference
PyTorch model.

Setup per head: random weights; a 512-position context (--context) is written into the drafter
KV cache by one prefill forward; then the step under test uses n = 3 pending rows (2 accepted
drafts + the bonus token) at positions ctx-3..ctx-1 and, for parallel mode, the mask rows at
ctx..ctx+K-2. Each step overwrites the same cache positions, so repetitions are identical.
Parallel and sequential runs alternate within a K so slow drift affects both alike; the figure
reported is the median of the repetitions (time.perf_counter) after warm-up.

Heads:
  tiny                 hidden 64, 2 layers, 4 heads / 2 kv heads, head_dim 16, intermediate 128,
                       vocab 512, draft vocab 384.
  gpt-oss-20b-peagle   random 4-layer head of the GPT-OSS-20B P-EAGLE shape: hidden 2880,
                       64 heads / 8 kv heads, head_dim 64, vocab = draft vocab = 201088,
                       target_hidden_size 2880. ASSUMED (the real config was not retrievable):
                       intermediate_size 2880 and rope llama3 (theta 150000, factor 32, low 1,
                       high 4, original_max_position_embeddings 4096). Built on the meta device,
                       then filled with N(0, 0.02) in fp32: 1.40 G params, 5.2 GiB.

Also printed: the head's lm_head matmul alone for [1, M, H] inputs (--lm-head-rows), because on CPU
the BLAS kernel changes with the row count M and that step dominates the big head's cost.

Run (about 1.5 minutes on 2 idle cores, ~6.5 GB peak RSS):
    peagle-trt bench drafter
    peagle-trt bench drafter --heads tiny --ks 1,3,7,11 --repeats 50 --context 512
Output: a markdown table on stdout, then as the LAST line one JSON object (env info + `rows`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import time
from dataclasses import asdict
from types import SimpleNamespace

import torch

from peagle_trt.bench.common import cpu_counters, cpu_model, other_cpu_share, progress
from peagle_trt.bench.report import emit, markdown_table
from peagle_trt.checkpoint.drafter import DrafterConfig
from peagle_trt.errors import ConfigError
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.models.drafter import DrafterModel
from peagle_trt.models.rope import RopeConfig, inv_freq
from peagle_trt.speculative.drafting import DraftBatch, ParallelDrafter, SequentialDrafter

PENDING = 3  # a = 2 accepted drafts + the bonus token

HEADS = {
    "tiny": dict(
        config=dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=128, vocab_size=512, draft_vocab_size=384, target_hidden_size=64,
                    rope=RopeConfig()),
        repeats=300, warmup=10, assumed=[]),
    "gpt-oss-20b-peagle": dict(
        config=dict(hidden_size=2880, num_layers=4, num_heads=64, num_kv_heads=8, head_dim=64,
                    intermediate_size=2880, vocab_size=201088, draft_vocab_size=201088,
                    target_hidden_size=2880,
                    rope=RopeConfig(theta=150000.0, rope_type="llama3",
                                    params={"factor": 32.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 4096},
                                    max_position_embeddings=131072)),
        repeats=7, warmup=2,
        assumed=["intermediate_size=2880",
                 "rope llama3 theta=150000 factor=32 low_freq_factor=1 high_freq_factor=4 "
                 "original_max_position_embeddings=4096",
                 "num_layers=4 (random weights, not the trained head)"]),
}


def build_head(name: str, seed: int = 0) -> DrafterModel:
    """A P-EAGLE head with random fp32 weights: built on meta, then materialized in place."""
    spec = HEADS[name]["config"]
    config = DrafterConfig(layout="aws", rms_norm_eps=1e-5, has_mask_hidden=True,
                           mask_token_id=spec["vocab_size"] - 1, **spec)
    with torch.device("meta"):
        model = DrafterModel(config)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # RMSNorm weights
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        model.d2t = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        model.mask_hidden = torch.empty(1, 1, config.num_aux * config.target_hidden_size).normal_(
            0.0, 1.0, generator=gen)
        model.inv_freq = inv_freq(config.rope, config.head_dim)[0]
        model.h_mask = model.project(model.mask_hidden).reshape(-1)
    return model.eval()


def prefill(model: DrafterModel, cache, context: int, gen: torch.Generator) -> None:
    """Write `context` positions of K/V into slot 0 with one forward (rows of random input)."""
    c = model.config
    tokens = torch.randint(0, c.vocab_size - 1, (1, context), generator=gen)
    hidden = torch.randn(1, context, c.hidden_size, generator=gen)
    positions = torch.arange(context)[None]
    model(tokens, hidden, positions, torch.zeros(1, dtype=torch.long), cache)


class DrafterOnlyExecutor:
    """TorchExecutor's drafting methods over a drafter and its cache, without a target model."""

    draft_parallel = TorchExecutor.draft_parallel
    drafter = TorchExecutor.drafter
    project = TorchExecutor.project
    to_target_ids = TorchExecutor.to_target_ids

    def __init__(self, model: DrafterModel, cache):
        self.drafter_model, self.drafter_cache = model, cache
        self.mask_token_id = model.config.mask_token_id
        self.device = model.fc.weight.device
        self._ops = contextlib.nullcontext  # the custom ops on their torch references


def make_steps(model: DrafterModel, cache, context: int, gen: torch.Generator):
    """Closures running one drafting step of K tokens in each mode; both return [1, K] target ids."""
    c = model.config
    ex = DrafterOnlyExecutor(model, cache)
    seq = SimpleNamespace(stats=SimpleNamespace(drafter_forwards=0))
    batch = DraftBatch(
        seqs=[seq],
        tokens=torch.randint(0, c.vocab_size - 1, (1, PENDING), generator=gen),
        aux=torch.randn(1, PENDING, c.num_aux * c.target_hidden_size, generator=gen),
        num_pending=torch.tensor([PENDING]),
        cur=torch.tensor([context]),  # pending rows at cur-n .. cur-1
        slots=torch.zeros(1, dtype=torch.long))
    parallel, sequential = ParallelDrafter(ex), SequentialDrafter(ex)
    return (lambda k: parallel.propose(batch, k)), (lambda k: sequential.propose(batch, k))


def timed(fn, k: int) -> float:
    t0 = time.perf_counter()
    fn(k)
    return (time.perf_counter() - t0) * 1e3


def bench_head(name: str, ks: list[int], context: int, repeats: int | None, warmup: int | None) -> list[dict]:
    spec = HEADS[name]
    repeats = repeats or spec["repeats"]
    warmup = spec["warmup"] if warmup is None else warmup
    t0 = time.perf_counter()
    model = build_head(name)
    n_params = sum(p.numel() for p in model.parameters())
    progress(f"[{name}] built: {n_params / 1e6:.1f} M params "
             f"({n_params * 4 / 2**30:.2f} GiB fp32) in {time.perf_counter() - t0:.1f} s")
    for a in spec["assumed"]:
        progress(f"[{name}] ASSUMED: {a}")
    gen = torch.Generator().manual_seed(1)
    cache = model.new_cache(1, context + max(ks))
    t0 = time.perf_counter()
    prefill(model, cache, context, gen)
    progress(f"[{name}] prefill of {context} positions: {time.perf_counter() - t0:.1f} s")
    parallel, sequential = make_steps(model, cache, context, gen)
    rows = []
    head_counters = cpu_counters()
    for k in ks:
        counters = cpu_counters()
        for _ in range(warmup):
            parallel(k)
            sequential(k)
        par, seq = [], []
        for _ in range(repeats):  # alternate so drift hits both modes alike
            par.append(timed(parallel, k))
            seq.append(timed(sequential, k))
        rows.append(dict(head=name, k=k, parallel_ms=statistics.median(par),
                         sequential_ms=statistics.median(seq),
                         parallel_ms_min=min(par), sequential_ms_min=min(seq),
                         parallel_rows=PENDING + k - 1, sequential_forwards=k,
                         repeats=repeats, warmup=warmup))
        share = other_cpu_share(counters, cpu_counters())
        rows[-1]["other_cpu_share"] = None if share is None else round(share, 3)
        progress(f"[{name}] K={k:<2d} parallel {rows[-1]['parallel_ms']:9.2f} ms   "
                 f"sequential {rows[-1]['sequential_ms']:9.2f} ms")
        if share is not None and share > 0.05:
            progress(f"[{name}] K={k:<2d} WARNING: other processes used {share:.0%} of the CPU time while "
                     "timing; these figures are noisy, rerun on an idle machine")
    head_share = other_cpu_share(head_counters, cpu_counters())
    for r in rows:  # per-K share when the K took long enough to measure, else the whole head's
        r["other_cpu_share_head"] = None if head_share is None else round(head_share, 3)
        share = r["other_cpu_share"] if r["other_cpu_share"] is not None else r["other_cpu_share_head"]
        r["noisy"] = share is not None and share > 0.05
    if head_share is not None and head_share > 0.05:
        progress(f"[{name}] WARNING: other processes used {head_share:.0%} of the CPU time while timing "
                 "this head; rerun on an idle machine")
    base = next((r["parallel_ms"] for r in rows if r["k"] == 1), None)
    for r in rows:
        r["seq_over_par"] = r["sequential_ms"] / r["parallel_ms"]
        r["par_over_par_k1"] = r["parallel_ms"] / base if base else None
    del model, cache
    return rows


def lm_head_probe(name: str, rows_list: list[int], repeats: int) -> list[dict]:
    """Time the head's lm_head matmul alone for [1, M, H] inputs: on CPU the BLAS kernel choice
    depends on M, which shows up in the parallel-mode figures (see docs/BENCHMARKS.md)."""
    c = HEADS[name]["config"]
    weight = torch.empty(c["draft_vocab_size"], c["hidden_size"]).normal_(0.0, 0.02)
    out = []
    for m in rows_list:
        x = torch.randn(1, m, c["hidden_size"])
        counters = cpu_counters()
        torch.nn.functional.linear(x, weight)  # warm-up
        times = [timed(lambda _: torch.nn.functional.linear(x, weight), m) for _ in range(repeats)]
        share = other_cpu_share(counters, cpu_counters())
        out.append(dict(head=name, rows=m, lm_head_ms=statistics.median(times), repeats=repeats,
                        other_cpu_share=None if share is None else round(share, 3)))
        noisy = "  (noisy: other processes busy)" if share is not None and share > 0.05 else ""
        progress(f"[{name}] lm_head alone, M={m:<2d} rows: {out[-1]['lm_head_ms']:10.3f} ms{noisy}")
    return out


def table(rows: list[dict]) -> str:
    """The markdown table of the drafting rows; `*` marks a row timed while other processes were busy."""
    body = [[r["head"], r["k"], f"{r['parallel_ms']:.2f}", f"{r['sequential_ms']:.2f}",
             f"{r['seq_over_par']:.2f}x",
             (f"{r['par_over_par_k1']:.2f}x" if r["par_over_par_k1"] is not None else "n/a")
             + (" *" if r["noisy"] else "")] for r in rows]
    text = markdown_table(["head", "K", "parallel ms", "sequential ms", "seq/par", "par K/par K=1"], body)
    if any(r["noisy"] for r in rows):
        text += "\n\n\\* other processes used > 5% of the CPU time while this row was timed: noisy figure"
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heads", default="tiny,gpt-oss-20b-peagle",
                        help=f"comma-separated heads from {sorted(HEADS)} (--smoke: tiny)")
    parser.add_argument("--ks", default="1,3,7,11", help="comma-separated draft lengths K")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repetitions per (head, K, mode); default: "
                             + ", ".join(f"{h} {s['repeats']}" for h, s in HEADS.items()))
    parser.add_argument("--warmup", type=int, default=None, help="warm-up runs per (head, K, mode)")
    parser.add_argument("--context", type=int, default=512, help="positions already in the KV cache")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--lm-head-rows", default="1,2,3,4,5,9,13",
                        help="also time each head's lm_head matmul alone for these row counts "
                             "('' to skip)")


def run(args: argparse.Namespace) -> dict:
    if args.smoke:  # tiny head, two K, a few repeats
        args.heads, args.ks, args.repeats, args.warmup = "tiny", "1,3", 3, 1
        args.context, args.lm_head_rows = 16, "1,2"
    heads = [h.strip() for h in args.heads.split(",") if h.strip()]
    ks = [int(k) for k in args.ks.split(",")]
    unknown = [h for h in heads if h not in HEADS]
    if unknown:
        raise ConfigError(f"unknown heads {unknown}; choose --heads from {sorted(HEADS)}")
    if min(ks) < 1 or args.context < PENDING:
        raise ConfigError(f"--ks must all be >= 1 and --context >= {PENDING}")

    lm_rows = [int(m) for m in args.lm_head_rows.split(",") if m.strip()]
    counters = cpu_counters()
    time.sleep(0.0 if args.smoke else 2.0)
    busy = other_cpu_share(counters, cpu_counters())
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    env = dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
               python=platform.python_version(), torch=torch.__version__, cpu=cpu_model(),
               threads=torch.get_num_threads(), context=args.context, pending_rows=PENDING,
               batch=1, dtype="float32", other_cpu_share_before=None if busy is None else round(busy, 3),
               loadavg_start=list(os.getloadavg()), smoke=args.smoke)
    progress(f"torch {env['torch']} | python {env['python']} | CPU {env['cpu']} | "
                f"torch threads {env['threads']} | context {args.context} | pending rows {PENDING}")
    if busy is not None and busy > 0.05:
        progress(f"WARNING: the CPUs were {busy:.0%} busy before starting; other processes compete for "
                    "the cores and the figures will be noisy")

    rows, lm_head = [], []
    with torch.inference_mode():
        for name in heads:
            rows += bench_head(name, ks, args.context, args.repeats, args.warmup)
            if lm_rows:
                lm_head += lm_head_probe(name, lm_rows, args.repeats or HEADS[name]["repeats"])
    text = f"## Drafting step, batch 1, context {args.context}: median ms\n\n{table(rows)}"
    if lm_head:
        text += ("\n\nlm_head matmul alone (ms) by row count M: "
                 + "; ".join(f"{h}: " + ", ".join(f"M={r['rows']} {r['lm_head_ms']:.3f}"
                                                  for r in lm_head if r["head"] == h) for h in heads))
    emit(args, text)
    env["loadavg_end"] = list(os.getloadavg())
    heads_info = {h: dict(config={k: (asdict(v) if isinstance(v, RopeConfig) else v)
                                  for k, v in HEADS[h]["config"].items()},
                          assumed=HEADS[h]["assumed"]) for h in heads}
    return dict(**env, heads=heads_info, rows=rows, lm_head=lm_head)
