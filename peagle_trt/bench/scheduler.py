"""Suite `scheduler` (docs/BENCHMARKS.md, "scheduler"): the host cost of one `Scheduler.step()` with a
no-op executor (forwards return views of preallocated zero tensors), so only the host work around the
models is timed: scheduler bookkeeping, SpecDecoder.step, KV block bookkeeping, ParallelDrafter.propose.
Exactly --accept drafts are accepted per step. Target: <= 0.3 ms per step at batch 64 (peagle, K = 7).
"""

from __future__ import annotations

import argparse

import torch

from peagle_trt.bench.harness import Figure, finish, int_list, progress, records, summary, timed
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
    for _ in range(warmup):  # the first step admits and prefills
        sched.step()
    assert len(sched.running) == batch and all(r.seq.prefilled for r in sched.running)
    tokens_before = sum(len(r.seq.output) for r in sched.running)
    st = summary([timed(sched.step) for _ in range(steps)], 1e3)
    assert len(sched.running) == batch, "a request finished while timed"
    tokens = sum(len(r.seq.output) for r in sched.running) - tokens_before
    return {"mode": mode, "k": k if mode != "none" else 0, "batch": batch,
            "accepted_per_step": min(accept, k) if mode != "none" else 0, "median_ms": round(st["median"], 4),
            "max_ms": round(st["max"], 4), "per_request_us": round(st["median"] * 1e3 / batch, 2),
            "tokens_per_step": round(tokens / steps / batch, 3)}


SMOKE = dict(steps=5, warmup=2, batches="1,4")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=300, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=30, help="untimed steps first (incl. the prefill step)")
    ap.add_argument("--accept", type=int, default=3, help="drafts accepted per step (default 3)")
    ap.add_argument("--batches", default="1,16,64", help="batch sizes for peagle K=7")


@torch.no_grad()  # scoped: a suite run in-process (tests, `peagle-trt bench`) leaves grad mode as it was
def run(args: argparse.Namespace) -> dict:
    big = 4 if args.smoke else 64  # the batch of the target and of the context configurations
    configs = [("peagle", 7, b, args.accept) for b in int_list(args.batches)]
    configs += [("peagle", 3, big, args.accept), ("none", 0, big, 0), ("peagle", 7, big, 0), ("peagle", 7, big, 7)]
    rows = []
    for mode, k, b, acc in configs:
        rows.append(run_config(mode, k, b, acc, args.steps, args.warmup))
        progress(f"  done: {mode} K={k} B={b} accept={acc}")
    main_row = next(r for r in rows if (r["mode"], r["k"], r["batch"]) == ("peagle", 7, big)
                    and r["accepted_per_step"] == min(args.accept, 7))
    return finish(args, "Scheduler.step() host overhead, no-op executor", [
        f"{args.steps} timed steps after {args.warmup} warm-up, greedy, ignore_eos, V={VOCAB}, H={HIDDEN}; ms",
        records(rows, ["mode", "k", "batch", "accepted_per_step", "median_ms", "max_ms", "per_request_us",
                       "tokens_per_step"], 4)],
        {"target_ms_at_batch_64": TARGET_MS,
         "target_met": main_row["median_ms"] <= TARGET_MS, "rows": rows},
        [Figure(f"scheduler step, batch {big}, peagle K=7 (host only)", main_row["median_ms"], "ms",
                f"<= {TARGET_MS} ms", 3)])
