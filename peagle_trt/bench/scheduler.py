"""Suite `scheduler` (docs/BENCHMARKS.md, "Scheduler host overhead per step"): the host-side cost of one
in-flight scheduler step, with model forwards that cost nothing.

What: the wall time of `Scheduler.step()` (runtime/scheduler.py) when the executor's forwards are
no-ops. One decode step then measures only the Python/host work around the models:
  scheduler bookkeeping (cancellation check, admission, prefill/decode split, `_report` and the
  per-request `on_output` callback), SpecDecoder.step (verify-input assembly, per-sequence greedy
  verification, commit, block tables), the KV block reservation and prefix-cache commit
  (runtime/blocks.py), and ParallelDrafter.propose (host side of the drafter inputs: padded
  pending tokens and target taps, num_pending / cur tensors, `.tolist()` of the drafts).
The no-op executor implements the `Executor` interface of executors/torch.py (`target`,
`draft_parallel`, `drafter`, `project`, `to_target_ids`, `device`, `kv`, `windows`; the scheduler
still assigns real KV blocks, so the block bookkeeping is timed) and returns slices of
preallocated zero tensors with a tiny vocabulary (V = 64) and hidden size (H = 8, aux = 3H), so
no model compute is timed. Since the P-EAGLE drafter inputs (token /
hidden / position rows) are built inside `Executor.draft_parallel` (device ops in the torch, ORT
and TensorRT executors), the host-side drafting work timed here is ParallelDrafter.propose:
padding the pending tokens and target taps, the per-batch index tensors and `.tolist()`.

Why: on a GPU the model forwards of a step take a few milliseconds; the host work of the step must
stay well below that or the GPU idles between steps. Target: <= 0.3 ms per step at batch 64
(peagle, K = 7).

Acceptance is fixed so every step does the same work: drafts are always token 0; the target's
argmax is 0 for rows < A and 1 at row A, so exactly A drafts are accepted
per step (A = --accept, default 3, i.e. acceptance length 4; A >= K means all K accepted). A
changes the pending length (A+1 tokens and target taps per sequence).

Method per configuration: a fresh scheduler; B long-running greedy requests (ignore_eos,
max_tokens large enough never to finish) are added and prefilled (16-token prompts), the batch is
warmed up for --warmup steps, then --steps individual `step()` calls are timed with
time.perf_counter. Reported: median and p90 ms per step, median µs per request (median / B),
tokens emitted per request per step (A+1) and "other CPU": the share of all CPU capacity used by
OTHER processes during the configuration (from /proc/stat; anything above a few % means the
figures are disturbed and should be re-run on an idle machine).
Configurations: peagle K=7 at B = 1, 16, 64 (the target), plus peagle K=3, spec mode none, and
K=7 with 0 and all drafts accepted, at B = 64, for context. With --profile (default on) the
B=64 K=7 configuration is also run under cProfile and the top functions by own time are printed.

Run (about 10 seconds on 2 idle cores):
    peagle-trt bench scheduler
    peagle-trt bench scheduler --steps 500 --warmup 50 --accept 3 --no-profile
Output: a markdown table on stdout, then as the LAST line one JSON object (env info + `rows`).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import os
import platform
import pstats
import statistics
import time

import torch

from peagle_trt.bench.common import cpu_model, progress
from peagle_trt.bench.report import emit, markdown_table
from peagle_trt.config import KVLayout, SamplingParams, SpecConfig
from peagle_trt.runtime.scheduler import Request, Scheduler
from peagle_trt.speculative.decoder import SpecDecoder

VOCAB, HIDDEN = 64, 8
TARGET_MS = 0.3


class NoOpExecutor:
    """The executor interface SpecDecoder / ParallelDrafter use, with forwards that do no compute:
    each returns views of preallocated zero tensors of the right shapes."""

    def __init__(self, num_seqs: int, max_len: int, max_rows: int, accept: int):
        self.device = torch.device("cpu")
        self.kv, self.windows = KVLayout.for_sequences(num_seqs, max_len), (0,)
        self.mask_token_id = VOCAB - 1
        self.h_mask = torch.zeros(HIDDEN)
        # target logits: argmax 0 on rows < accept, 1 from row `accept` on -> `accept` drafts of
        # token 0 are accepted, then token 1 is the correction (or the bonus when accept >= K)
        self._t_logits = torch.zeros(num_seqs, max_rows, VOCAB)
        self._t_logits[:, accept:, 1] = 1.0
        self._aux = torch.zeros(num_seqs, max_rows, 3 * HIDDEN)
        self._d_logits = torch.zeros(num_seqs, max_rows, VOCAB)  # drafts: always token 0
        self._prenorm = torch.zeros(num_seqs, max_rows, HIDDEN)
        self._drafts = torch.zeros(num_seqs, max_rows, dtype=torch.long)  # draft ids: token 0

    # -- forwards ------------------------------------------------------------------------------
    def target(self, tokens, positions, tables, logit_rows=None, tree_mask=None):
        b, s = tokens.shape
        if logit_rows is not None:  # prefill: only the requested rows (here: the last one)
            return self._t_logits[:b, s - 1:s].expand(b, logit_rows.shape[1], VOCAB), self._aux[:b, :s]
        return self._t_logits[:b, :s], self._aux[:b, :s]

    def draft_parallel(self, tokens, aux, num_pending, cur, tables, k):
        # P-EAGLE one-pass draft: input rows, drafter forward and sampling all happen in the
        # executor (device ops in a real one) -> draft ids [B, K]
        return self._drafts[:tokens.shape[0], :k]

    def drafter(self, tokens, hidden, positions, tables):  # sequential (EAGLE-3) drafting only
        b, s = tokens.shape
        return self._d_logits[:b, :s], self._prenorm[:b, :s]

    def project(self, aux):
        return aux[..., :HIDDEN]

    def to_target_ids(self, ids):
        return ids


def make_scheduler(mode: str, k: int, batch: int, accept: int, prompt_len: int) -> Scheduler:
    max_len = 1 << 14  # never reached: no request finishes while timed
    ex = NoOpExecutor(batch, max_len, max_rows=prompt_len + 2 * k + 2, accept=accept)
    decoder = SpecDecoder(ex, SpecConfig(mode, k if mode != "none" else 1))
    sched = Scheduler(decoder, max_batch=batch, prefill_chunk=256, max_queue=batch)
    params = SamplingParams(max_tokens=max_len // 2, ignore_eos=True)
    for i in range(batch):
        prompt = [(7 * i + j) % (VOCAB - 2) + 2 for j in range(prompt_len)]
        sched.add(Request(f"r{i}", prompt, params, on_output=lambda out: None))
    return sched


def run_config(mode: str, k: int, batch: int, accept: int, steps: int, warmup: int,
               prompt_len: int = 16) -> dict:
    sched = make_scheduler(mode, k, batch, accept, prompt_len)
    cpu0 = cpu_sample()
    for _ in range(warmup):  # the first step admits and prefills
        sched.step()
    assert len(sched.running) == batch and all(r.seq.prefilled for r in sched.running)
    tokens_before = sum(len(r.seq.output) for r in sched.running)
    times = []
    clock = time.perf_counter
    for _ in range(steps):
        t0 = clock()
        sched.step()
        times.append(clock() - t0)
    assert len(sched.running) == batch, "a request finished while timed"
    tokens = sum(len(r.seq.output) for r in sched.running) - tokens_before
    times_ms = sorted(t * 1e3 for t in times)
    med = statistics.median(times_ms)
    p90 = times_ms[min(len(times_ms) - 1, int(round(0.9 * (len(times_ms) - 1))))]
    return {"mode": mode, "k": k if mode != "none" else 0, "batch": batch,
            "accepted_per_step": (min(accept, k) if mode != "none" else 0),
            "steps": steps, "median_ms": round(med, 4), "p90_ms": round(p90, 4),
            "mean_ms": round(statistics.fmean(times_ms), 4),
            "per_request_us": round(med * 1e3 / batch, 2),
            "tokens_per_step": round(tokens / steps / batch, 3),
            "other_cpu_share": busy_elsewhere(cpu0, cpu_sample())}


def profile_config(mode: str, k: int, batch: int, accept: int, steps: int, warmup: int,
                   top: int = 15) -> tuple[str, list[dict]]:
    sched = make_scheduler(mode, k, batch, accept, 16)
    for _ in range(warmup):
        sched.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        sched.step()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("tottime")
    stats.print_stats(top)
    rows = []
    by_own_time = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (file, line, func), (_, nc, tt, ct, _) in by_own_time:
        rows.append({"function": f"{os.path.relpath(file) if file.startswith('/') else file}:{line}({func})",
                     "calls_per_step": round(nc / steps, 1),
                     "tottime_us_per_step": round(tt / steps * 1e6, 1),
                     "cumtime_us_per_step": round(ct / steps * 1e6, 1)})
    return buf.getvalue(), rows


def cpu_sample() -> tuple[float, float, float] | None:
    """(seconds of all CPUs, their busy seconds, this process's CPU seconds) from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    t = os.times()
    return sum(ticks) / hz, (sum(ticks) - ticks[3] - ticks[4]) / hz, t.user + t.system


def busy_elsewhere(a, b) -> float | None:
    """Fraction of all CPU capacity between two samples used by other processes (noise indicator)."""
    if a is None or b is None or b[0] <= a[0]:
        return None
    return round(max(0.0, (b[1] - a[1]) - (b[2] - a[2])) / (b[0] - a[0]), 3)


def table(rows: list[dict]) -> str:
    return markdown_table(
        ["mode", "K", "batch", "acc/step", "median ms", "p90 ms", "µs/request", "tok/req/step", "other CPU"],
        [[r["mode"], r["k"], r["batch"], r["accepted_per_step"], f"{r['median_ms']:.3f}", f"{r['p90_ms']:.3f}",
          f"{r['per_request_us']:.1f}", f"{r['tokens_per_step']:.2f}",
          "-" if r["other_cpu_share"] is None else format(r["other_cpu_share"], ".0%")] for r in rows])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=300, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=30, help="untimed steps first (incl. the prefill step)")
    ap.add_argument("--accept", type=int, default=3, help="drafts accepted per step (default 3)")
    ap.add_argument("--batches", default="1,16,64", help="batch sizes for peagle K=7")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="cProfile the batch-64 K=7 configuration")


@torch.no_grad()  # scoped: a suite run in-process (tests, `peagle-trt bench`) leaves grad mode as it was
def run(args: argparse.Namespace) -> dict:
    big = 64  # the batch of the target and of the context configurations
    if args.smoke:  # a few steps at batches 1 and 4, no profile
        args.steps, args.warmup, args.batches, args.profile, big = 5, 2, "1,4", False, 4

    configs = [("peagle", 7, b, args.accept) for b in map(int, args.batches.split(","))]
    configs += [("peagle", 3, big, args.accept), ("none", 0, big, 0),
                ("peagle", 7, big, 0), ("peagle", 7, big, 7)]
    rows = []
    for mode, k, b, acc in configs:
        rows.append(run_config(mode, k, b, acc, args.steps, args.warmup))
        progress(f"  done: {mode} K={k} B={b} accept={acc}")

    text = [(f"## Scheduler.step() host overhead, no-op executor (V={VOCAB}, H={HIDDEN}), "
             f"{args.steps} timed steps after {args.warmup} warm-up, greedy, ignore_eos"), "", table(rows)]
    main_row = next((r for r in rows if r["mode"] == "peagle" and r["k"] == 7 and r["batch"] == 64
                     and r["accepted_per_step"] == min(args.accept, 7)), None)
    met = main_row is not None and main_row["median_ms"] <= TARGET_MS
    if main_row is not None:
        text += ["", (f"target: <= {TARGET_MS} ms per step at batch 64 (peagle K=7): "
                  f"{'MET' if met else 'NOT MET'} (median {main_row['median_ms']:.3f} ms, "
                  f"{main_row['median_ms'] / TARGET_MS:.1f}x the target)")]

    profile = None
    if args.profile:
        psteps = max(50, args.steps // 3)
        _, profile = profile_config("peagle", 7, 64, args.accept, psteps, args.warmup)
        text += ["", (f"### cProfile, peagle K=7 batch 64, {psteps} steps, top functions by own time "
                  "(per step; cProfile inflates Python-call-heavy code)"), "",
                 markdown_table(["own µs/step", "cum µs/step", "calls/step", "function"],
                                [[f"{p['tottime_us_per_step']:.1f}", f"{p['cumtime_us_per_step']:.1f}",
                                  f"{p['calls_per_step']:.1f}", f"`{p['function']}`"] for p in profile])]
    emit(args, "\n".join(text))

    env = {"benchmark": "scheduler_step_host_overhead",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "cpu": cpu_model(),
           "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "steps": args.steps, "warmup": args.warmup, "vocab": VOCAB, "hidden": HIDDEN,
           "target_ms_at_batch_64": TARGET_MS, "target_met": met, "smoke": args.smoke}
    return dict(**env, rows=rows, profile=profile)
