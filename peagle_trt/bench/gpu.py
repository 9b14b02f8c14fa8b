"""Suites `gpu` and `drafter` (docs/BENCHMARKS.md, one section each): the speculate-verify step at real
shapes, random weights, torch executor, CUDA events.

`gpu` (a Llama-3.1-8B-class target, bf16, context 1024 unless --context): copy bandwidth (the MBU
reference), drafting (parallel vs sequential), decode and verify (bf16, FP8; torch references and
Triton kernels) with CUDA graphs off and on in the one run (peagle_trt/executors/graphs.py), the
iteration overhead and its host syncs, profile rows (kernels by device time, host ops by self time),
a PROJECTION of tokens/s from published acceptance lengths, the batch-1 decode beside two peers
(gpt-fast and transformers' compiled static-cache `generate`, peagle_trt/bench/gpu_peers.py) and the
long-context rows (decode, verify and the step at 8K and 32K, the attention split over the context).
`--sections` runs a subset (scripts/gpu_validate.sh runs them as stages of their own); the report
checks the targets (`check_targets`) on what was measured. OUTPUT_DIR (default $OUT, else
gpu_results)/bench_gpu.json is rewritten after every section; `commit` is PEAGLE_COMMIT, else this
checkout's git HEAD. --smoke: tiny shapes on the CPU (peers eager unless --peer-compile says
otherwise; tests/bench/test_bench_gpu_smoke.py).

`drafter`: drafting alone on CPU, batch 1, fp32, per --heads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from peagle_trt.architecture import TargetConfig
from peagle_trt.bench import gpu_peers
from peagle_trt.bench.decode import model_costs
from peagle_trt.bench.forwards import forward
from peagle_trt.bench.gpu_report import check_targets, figures, report, section_projection
from peagle_trt.bench.harness import (
    Figure,
    alternate,
    device_clock,
    finish,
    int_list,
    machine,
    median_ms,
    options,
    progress,
    records,
    summary,
)
from peagle_trt.bench.results import source_commit
from peagle_trt.checkpoint.drafter import DrafterConfig
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.models.drafter import DrafterModel
from peagle_trt.models.fp8 import FP8_DTYPE, FP8_MAX, FP8Linear
from peagle_trt.models.rope import RopeConfig, inv_freq
from peagle_trt.models.target import TargetModel
from peagle_trt.ops import kernels as cuda_kernels
from peagle_trt.speculative.decoder import Sequence, SpecDecoder
from peagle_trt.speculative.drafting import DraftBatch, ParallelDrafter, SequentialDrafter
from peagle_trt.speculative.stats import SpecStats

LLAMA3_ROPE = RopeConfig(theta=500000.0, rope_type="llama3", max_position_embeddings=131072,
                         params={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})
GPT_OSS_ROPE = RopeConfig(theta=150000.0, rope_type="llama3", max_position_embeddings=131072,
                          params={"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 4096})
TARGETS = {  # TargetConfig(arch, vocab, hidden, layers, heads, kv heads, head_dim, intermediate, eps, rope)
    "llama-3.1-8b": TargetConfig("llama", 128256, 4096, 32, 32, 8, 128, 14336, 1e-5, LLAMA3_ROPE),
    "tiny": TargetConfig("llama", 512, 64, 4, 4, 2, 16, 128, 1e-5, RopeConfig()),  # taps (2, 2, 1)
}
HEADS = {  # P-EAGLE heads (aws layout). ASSUMED where the real config is unknown: see ASSUMED
    "gpt-oss-20b-peagle": dict(hidden_size=2880, num_layers=4, num_heads=64, num_kv_heads=8, head_dim=64,
                               intermediate_size=2880, vocab_size=201088, draft_vocab_size=201088,
                               target_hidden_size=2880, rope=GPT_OSS_ROPE),
    "llama-3.1-8b-peagle": dict(hidden_size=4096, num_layers=4, num_heads=32, num_kv_heads=8, head_dim=128,
                                intermediate_size=14336, vocab_size=128256, draft_vocab_size=32000,
                                target_hidden_size=4096, rope=LLAMA3_ROPE),
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                 vocab_size=512, draft_vocab_size=384, target_hidden_size=64, rope=RopeConfig()),
}
ASSUMED = {"gpt-oss-20b-peagle": "intermediate 2880 and llama3 rope (theta 150000, factor 32) assumed; random",
           "llama-3.1-8b-peagle": "4 layers, intermediate 14336, draft vocab 32000 assumed (no public config)"}
DRAFTER_REPEATS = {"tiny": (300, 10), "gpt-oss-20b-peagle": (7, 2)}  # suite `drafter`: head -> repeats, warm-up
PRESETS = {"drafter": dict(context=512)}
SMOKE = dict(heads="tiny", ks="1,3", repeats=3, warmup=1, context=16)  # `drafter`; `gpu` sets its own sizes


def randomize(model: nn.Module, device, dtype) -> nn.Module:
    """Materialize a meta-device model on `device` in `dtype` with N(0, 0.02) weights, unit norms."""
    model = model.to(dtype=dtype).to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02)
    return model.eval().requires_grad_(False)


def build_target(name: str, device, dtype) -> TargetModel:
    c = TARGETS[name]
    with torch.device("meta"):
        model = TargetModel(c, c.default_taps)
    model = randomize(model, device, dtype)
    model.inv_freq = inv_freq(c.rope, c.head_dim)[0].to(device=device, dtype=dtype)  # as from_tensors
    return model


def build_head(name: str, device, dtype) -> DrafterModel:
    spec = HEADS[name]
    config = DrafterConfig(layout="aws", rms_norm_eps=1e-5, has_mask_hidden=True,
                           mask_token_id=spec["vocab_size"] - 1, **spec)
    with torch.device("meta"):
        model = DrafterModel(config)
    model = randomize(model, device, dtype)
    with torch.no_grad():
        model.d2t = torch.zeros(config.draft_vocab_size, dtype=torch.long, device=device)
        model.mask_hidden = torch.randn(1, 1, config.num_aux * config.target_hidden_size, device=device,
                                        dtype=dtype)
        model.inv_freq = inv_freq(config.rope, config.head_dim)[0].to(device=device, dtype=dtype)
        model.h_mask = model.project(model.mask_hidden).reshape(-1)
    return model


def to_fp8(model: TargetModel) -> None:
    """Every decoder-layer nn.Linear becomes an FP8Linear (per-tensor E4M3, ModelOpt's layout) of its own
    weights; lm_head and embeddings stay unquantized (as `peagle-trt quantize`)."""
    for name, m in list(model.layers.named_modules()):
        if type(m) is not nn.Linear:
            continue
        w = m.weight.float()
        with torch.device(w.device):
            new = FP8Linear(m.in_features, m.out_features, m.bias is not None)
        scale = w.abs().max().clamp(min=1e-12) / FP8_MAX
        new.weight.data = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        new.weight_scale.data = scale.reshape(())
        new.input_scale.data = torch.tensor(4.0 / FP8_MAX, device=w.device)  # activations of amax ~4
        if m.bias is not None:
            new.bias.data = m.bias.data
        parent, _, child = name.rpartition(".")
        setattr(model.layers.get_submodule(parent) if parent else model.layers, child, new)
        del w


class DrafterOnlyExecutor:
    """TorchExecutor's drafting methods over a drafter and its cache (no target needed to draft)."""

    draft_parallel, drafter = TorchExecutor.draft_parallel, TorchExecutor.drafter
    project, to_target_ids = TorchExecutor.project, TorchExecutor.to_target_ids
    _draft_eager, graphs = TorchExecutor._draft_eager, None  # eager: the drafting section times launches too

    def __init__(self, model: DrafterModel, slots: int, max_len: int, kernels: str):
        self.drafter_model, self.drafter_cache = model, model.new_cache(slots, max_len)
        self.mask_token_id, self.device = model.config.mask_token_id, model.fc.weight.device
        self._ops = cuda_kernels.routed if kernels == "cuda" else contextlib.nullcontext


def section_drafter(a, head: str, device, dtype, kernels: str = "reference", pending: int = 3) -> list[dict]:
    """One drafting step per (batch, K): P-EAGLE's one parallel pass vs EAGLE-3's K sequential passes,
    through the real drafting classes, `pending` rows (accepted drafts + the bonus) at a.context."""
    model = build_head(head, device, dtype)
    c, rows = model.config, []
    ex = DrafterOnlyExecutor(model, max(a.batches), a.context + max(a.draft_ks) + 8, kernels)
    parallel, sequential = ParallelDrafter(ex), SequentialDrafter(ex)
    for b in a.batches:
        seqs = [Sequence([0], SamplingParams(), i, stats=SpecStats(1)) for i in range(b)]
        aux = torch.randn(b, pending, c.num_aux * c.target_hidden_size, device=device, dtype=dtype)
        full = [torch.full((b,), v, dtype=torch.long, device=device) for v in (pending, a.context)]
        batch = DraftBatch(seqs, torch.randint(0, c.vocab_size - 1, (b, pending), device=device), aux, *full,
                           torch.arange(b, device=device))
        for k in a.draft_ks:
            t = alternate({"parallel": lambda: parallel.propose(batch, k),
                           "sequential": lambda: sequential.propose(batch, k)},
                          a.repeats, a.warmup, clock=device_clock)
            par, seq = summary(t["parallel"], 1e3), summary(t["sequential"], 1e3)
            rows.append({"head": head, "kernels": kernels, "batch": b, "k": k, "parallel_ms": par["median"],
                         "sequential_ms": seq["median"], "parallel_spread": par["spread"],
                         "sequential_spread": seq["spread"], "seq_over_par": seq["median"] / par["median"]})
            progress(f"[{a.suite}] {head} B={b} K={k}: parallel {par['median']:.2f} ms, sequential "
                     f"{seq['median']:.2f} ms")
    for r in rows:
        k1 = next((x["parallel_ms"] for x in rows if (x["batch"], x["k"]) == (r["batch"], 1)), None)
        r["par_over_par_k1"] = r["parallel_ms"] / k1 if k1 else None
    return rows


def section_target(a, ex, weights: str, copy_gbs: float, context: int | None = None) -> list[dict]:
    """Decode (k = 0: one row) and verify (k + 1 rows); floor = bytes read / the copy bandwidth."""
    costs, rows, context = model_costs(ex.target_model), [], context or a.context
    for b in a.batches:
        for k in [0] + list(a.ks):
            t = median_ms(forward(ex, b, k + 1, context), a.repeats, a.warmup)
            read = costs["weight_bytes"] + b * costs["kv_bytes_per_pos"] * (context + k + 1)
            floor = read / (copy_gbs * 1e6) if copy_gbs else None
            rows.append({"weights": weights, "kernels": ex.kernels, "graphs": ex.graphs is not None, "batch": b,
                         "k": k, "ms": t, "floor_ms": floor, "mbu": floor / t if floor else None})
    return rows


def count_syncs(fn) -> list[str]:
    """The host synchronisations `fn()` performs (CUDA only): torch's sync debug warnings."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [str(w.message).splitlines()[0][:120] for w in caught if "synchroniz" in str(w.message).lower()]


def sequences(ex, b: int, context: int, k: int) -> list[Sequence]:
    """`b` fresh sequences at position `context`, request i in the blocks `forward` addresses, each
    with one generated token and `k` drafts pending."""
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    tables = ex.target_cache.tables(torch.arange(b, device=ex.device)).tolist()  # [G, B, M]
    seqs = [Sequence([1] * context, params, None, stats=SpecStats(k), num_computed=context, cur=context,
                     blocks=[group[i] for group in tables]) for i in range(b)]
    for s in seqs:
        s.output, s.drafts = [2], [3] * k
    return seqs


def section_iteration(a, ex, device, context: int | None = None, modes=("none", "eagle3", "peagle")) -> list[dict]:
    """One SpecDecoder.step minus its verify and draft forwards (timed alone), per mode and batch."""
    rows, hidden, context = [], ex.target_model.config.hidden_size, context or a.context
    for mode in modes:
        spec = SpecConfig(mode, a.iter_k)
        decoder = SpecDecoder(ex, spec)
        for b in a.batches:
            seqs = sequences(ex, b, context, spec.num_spec_tokens)
            step_ms = median_ms(lambda: decoder.step(seqs), a.repeats, a.warmup)
            verify_ms = median_ms(forward(ex, b, spec.num_spec_tokens + 1, context), a.repeats, a.warmup)
            draft_ms = 0.0
            if spec.num_spec_tokens:
                def full(v):
                    return torch.full((b,), v, dtype=torch.long, device=device)
                batch = DraftBatch(seqs, full(0)[:, None], torch.randn(b, 1, 3 * hidden, device=device,
                                   dtype=ex.target_model.lm_head.weight.dtype), full(1), full(context + 1),
                                   torch.arange(b, device=device))
                draft_ms = median_ms(lambda: decoder.proposer.propose(batch, spec.num_spec_tokens), a.repeats, a.warmup)
            # one expected: the read of the accepted tokens; the verify's host ints go up non-blocking from
            # pinned memory (peagle_trt/speculative/drafting.py `upload`). 5 on the H200 of 2026-11-28, before
            # that upload (4 synchronous copies + the read)
            syncs = count_syncs(lambda: decoder.step(seqs)) if device.type == "cuda" else None
            rows.append({"mode": mode, "k": spec.num_spec_tokens, "batch": b, "kernels": ex.kernels,
                         "graphs": ex.graphs is not None, "step_ms": step_ms,
                         "verify_ms": verify_ms, "draft_ms": draft_ms, "overhead_ms": step_ms - verify_ms - draft_ms,
                         "host_syncs": None if syncs is None else len(syncs),
                         "sync_examples": None if syncs is None else sorted(set(syncs))[:6]})
    return rows


def profile_rows(fn, what: str, top: int = 12) -> list[dict]:
    """torch.profiler over `fn()`: its `top` device kernels by total time (count, us), its `top` host ops
    by self time, and the number of kernels it launched: where a graph-replayed forward spends its time
    (kernels) and where the step's host time goes (ops)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    fn()  # warm: nothing compiles or captures inside the profile
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()

    def device_us(e) -> float:
        return float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0) or 0.0)

    kernels = [e for e in events if device_us(e) > 0 and getattr(e, "device_type", None) is not None
               and "CUDA" in str(e.device_type)]
    rows = [{"what": what, "kind": "kernels launched", "name": "(all)", "calls": sum(e.count for e in kernels),
             "us": round(sum(device_us(e) for e in kernels), 1)}]
    rows += [{"what": what, "kind": "kernel", "name": e.key[:80], "calls": e.count, "us": round(device_us(e), 1)}
             for e in sorted(kernels, key=device_us, reverse=True)[:top]]
    host = [e for e in events if e not in kernels and e.self_cpu_time_total > 0]
    rows += [{"what": what, "kind": "host op", "name": e.key[:80], "calls": e.count,
              "us": round(e.self_cpu_time_total, 1)} for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:top]]
    return rows


def section_profile(a, ex, device) -> list[dict]:
    """Profiles of a batch-1 decode forward (graph-replayed when the executor captures) and of one
    P-EAGLE step at the smallest and largest batch (`profile_rows`)."""
    rows = profile_rows(forward(ex, 1, 1, a.context), "decode forward, batch 1")
    decoder = SpecDecoder(ex, SpecConfig("peagle", a.iter_k))
    for b in (min(a.batches), max(a.batches)):
        seqs = sequences(ex, b, a.context, a.iter_k)
        rows += profile_rows(lambda: decoder.step(seqs), f"peagle step K={a.iter_k}, batch {b}")
    return rows


def step_margin(a) -> int:
    """KV positions a timed step loop may add past its context (every step could accept K + 1)."""
    return 64 + (a.repeats + a.warmup + 2) * (a.iter_k + 1)


def section_long(a, model, drafter, kern: str, graphs: bool, copy_gbs: float | None, device) -> list[dict]:
    """Batch 1 at each long context (`a.long_contexts`): decode and verify forwards (MBU with the KV
    read), then the step with none and P-EAGLE; on the kernels the attention splits over the context
    by shape (peagle_trt/ops/triton_kernels/kv_attention.py)."""
    rows = []
    for context in a.long_contexts:
        ex = TorchExecutor(model, drafter, 1, context + step_margin(a), kernels=kern, cuda_graphs=graphs)
        one = argparse.Namespace(**{**vars(a), "batches": (1,), "ks": (a.iter_k,)})
        rows += [{**r, "context": context, "part": "forward", "mode": "decode" if r["k"] == 0 else "verify"}
                 for r in section_target(one, ex, "bf16", copy_gbs, context)]
        rows += [{**r, "context": context, "part": "step"}
                 for r in section_iteration(one, ex, device, context, ("none", "peagle"))]
        progress(f"[bench gpu] long context {context}: " + ", ".join(
            f"{r['part']} {r['mode']} {r['ms'] if 'ms' in r else r['step_ms']:.2f} ms"
            for r in rows if r["context"] == context))
        ex = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def section_peers(a, model, drafter, kern: str, graphs: bool, copy_gbs: float | None, device, dtype) -> list[dict]:
    """Our batch-1 decode (SpecDecoder.step, target only, `a.peer_tokens` steps a call from fresh
    sequences at the context) beside gpt-fast's and transformers', alternated (peagle_trt/bench/gpu_peers.py)."""
    n = a.peer_tokens
    ex = TorchExecutor(model, drafter, 1, a.context + n + 64, kernels=kern, cuda_graphs=graphs)
    decoder = SpecDecoder(ex, SpecConfig("none", 0))

    def ours():
        seqs = sequences(ex, 1, a.context, 0)
        for _ in range(n):
            decoder.step(seqs)
    costs = model_costs(model)
    step_bytes = costs["weight_bytes"] + costs["kv_bytes_per_pos"] * (a.context + n // 2)
    label = f"SpecDecoder.step, target only, kernels {kern}{', CUDA graphs' if graphs else ''}"
    return gpu_peers.compare(ours, n, TARGETS[a.target_shape], a.target_shape, device, dtype, a.context, step_bytes,
                             copy_gbs, a.gpt_fast, a.peer_compile, a.peer_rounds, label, a.deadline)


SECTIONS = ("copy", "drafter", "target", "fp8", "iteration", "profile", "projection", "peers", "long-context")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget-s", type=float, default=300.0, help="gpu: skip the sections that start later")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"gpu: comma-separated, from {SECTIONS} (copy joins any that reports MBU)")
    p.add_argument("--gpt-fast", type=Path, default=None, metavar="DIR",
                   help="gpu peers: a gpt-fast checkout (github.com/pytorch-labs/gpt-fast), used in place")
    p.add_argument("--peer-compile", default="auto", choices=gpu_peers.COMPILE_MODES,
                   help="gpu peers: torch.compile mode (auto: reduce-overhead on CUDA, off on a CPU)")
    p.add_argument("--peer-tokens", type=int, default=None, help="gpu peers: tokens per timed call (32; smoke 3)")
    p.add_argument("--peer-rounds", type=int, default=None, help="gpu peers: alternated rounds (5; smoke 2)")
    p.add_argument("--long-contexts", default=None, help="gpu: contexts of the long rows (8192,32768; smoke 32,48)")
    p.add_argument("--kernel-modes", default="reference,cuda",
                   help="gpu: the custom ops' backends timed, in order (cuda: the Triton kernels, where they run; "
                        "the last is the product's, the one the step, peers and long rows use)")
    p.add_argument("--heads", default="tiny,gpt-oss-20b-peagle", help=f"drafter: from {sorted(DRAFTER_REPEATS)}")
    p.add_argument("--ks", default="1,3,7,11", help="drafter: comma-separated draft lengths K")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="gpu: time eager forwards only (default on CUDA: with CUDA graphs off and on)")
    options(p, context=None, repeats=None, warmup=None, threads=None)  # None: gpu 1024; drafter: DRAFTER_REPEATS


def run_drafter(args: argparse.Namespace) -> dict:
    """Suite `drafter`: the drafting section at batch 1 on CPU, fp32, per head."""
    heads, ks = args.heads.split(","), int_list(args.ks)
    if set(heads) - set(DRAFTER_REPEATS) or min(ks) < 1 or args.context < 3:
        raise ConfigError(f"--heads from {sorted(DRAFTER_REPEATS)}, --ks all >= 1, --context >= 3")
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    rows = []
    with torch.inference_mode():
        for h in heads:
            repeats, warmup = DRAFTER_REPEATS[h]
            warmup = warmup if args.warmup is None else args.warmup
            a = argparse.Namespace(batches=(1,), draft_ks=ks, context=args.context, suite=args.suite,
                                   repeats=args.repeats or repeats, warmup=warmup)
            rows += section_drafter(a, h, torch.device("cpu"), torch.float32)
    k = max(k for k in ks if k <= 7)
    figures_ = [Figure(f"drafting step, {r['head']} head, P-EAGLE K={k} over K=1", r["par_over_par_k1"], "x", "<= 1.5x")
                for r in rows if r["k"] == k and r["par_over_par_k1"]]
    figures_ += [Figure(f"drafting step, {r['head']} head, K={k}: EAGLE-3 over P-EAGLE", r["seq_over_par"], "x")
                 for r in rows if r["k"] == k]
    return finish(args, "Drafter forward: P-EAGLE parallel vs EAGLE-3 sequential", [
        f"Drafting step, batch 1, context {args.context}, 3 pending rows: median ms",
        records(rows, ["head", "k", "parallel_ms", "sequential_ms", "seq_over_par", "par_over_par_k1"])],
        {"context": args.context, "batch": 1, "dtype": "float32", "rows": rows,
         "heads": {h: {"config": {k: str(v) for k, v in HEADS[h].items()}, "assumed": ASSUMED.get(h)} for h in heads}},
        figures_)


def configure(a: argparse.Namespace, device) -> None:
    """The run's sizes and sections on `a` (smoke: tiny shapes on the CPU)."""
    a.output_dir = a.output_dir or Path(os.environ.get("OUT") or "gpu_results")
    a.output_dir.mkdir(parents=True, exist_ok=True)
    a.batches, a.ks, a.draft_ks = ((1, 2), (1, 3), (1, 3)) if a.smoke else ((1, 16, 64), (3, 7, 11), (1, 3, 7, 11))
    a.iter_k, a.context = (3, a.context or 16) if a.smoke else (7, a.context or 1024)
    a.repeats, a.warmup = (2, 1) if a.smoke else (10, 3)
    a.peer_tokens = a.peer_tokens or (3 if a.smoke else 32)
    a.peer_rounds = a.peer_rounds or (2 if a.smoke else 5)
    a.long_contexts = int_list(a.long_contexts or ("32,48" if a.smoke else "8192,32768"))
    a.target_shape = "tiny" if a.smoke else "llama-3.1-8b"
    a.section_list = a.sections.split(",")
    unknown = set(a.section_list) - set(SECTIONS)
    if unknown or a.peer_tokens < 2:
        raise ConfigError(f"--sections {sorted(unknown)} unknown (from {SECTIONS}); --peer-tokens >= 2")
    if {"target", "fp8", "peers", "long-context", "projection"} & set(a.section_list):
        a.section_list = ["copy"] + [s for s in a.section_list if s != "copy"]  # their MBU needs the bandwidth


def refigure(res: dict) -> list[Figure]:
    """The headline figures of a saved run (its rows), by the current targets: `bench report --record-run`."""
    res["targets"] = check_targets(res)
    return figures(res)


def run(a: argparse.Namespace) -> dict:
    if a.suite == "drafter":
        return run_drafter(a)
    t0 = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not a.smoke:
        raise ConfigError("no CUDA device: the GPU benchmark needs one (torch.cuda.is_available() is False); "
                          "run it on an H100/H200 (scripts/gpu_validate.sh), or pass --smoke for the CPU smoke run")
    configure(a, device)
    a.deadline, want = t0 + a.budget_s, set(a.section_list)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, heads = ("tiny", ["tiny"]) if a.smoke else ("llama-3.1-8b", ["gpt-oss-20b-peagle", "llama-3.1-8b-peagle"])
    usable = {"reference", *(["cuda"] if device.type == "cuda" and cuda_kernels.available() else [])}
    kernel_modes = [m for m in a.kernel_modes.split(",") if m in usable]
    if not kernel_modes or set(a.kernel_modes.split(",")) - {"reference", "cuda"}:
        raise ConfigError(f"--kernel-modes {a.kernel_modes!r}: from reference, cuda; usable here: {sorted(usable)} "
                          "(cuda needs a GPU and triton)")
    graph_modes = (False, True) if device.type == "cuda" and not a.no_cuda_graphs else (False,)
    kern, graphs = kernel_modes[-1], graph_modes[-1]  # the product's configuration
    env = {"device": str(device), "cuda": torch.version.cuda, "triton_kernels": cuda_kernels.available()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, sm=f"{p.major}.{p.minor}", gpu_memory_gib=round(p.total_memory / 2**30, 1))
    res = {"smoke": a.smoke, "env": env, "device": env.get("gpu", env["device"]), "machine": machine(a.smoke),
           "commit": source_commit(), "target_shape": target, "heads": heads, "sections": a.section_list,
           "assumed": {h: ASSUMED.get(h) for h in heads}, "context": a.context, "dtype": str(dtype),
           "kernels_used": kern, "graphs_used": graphs, "kernel_modes": kernel_modes, "skipped": [], "errors": {}}

    def section(name: str, fn) -> None:
        if time.monotonic() - t0 > a.budget_s:
            res["skipped"].append(name)
            return progress(f"[bench gpu] {name}: skipped (budget {a.budget_s:.0f} s spent)")
        progress(f"[bench gpu] {name} ...")
        try:
            res.setdefault(name.split(":")[0], []).extend(fn())
        except Exception as exc:  # a failed section must not lose the others: recorded, reported
            res["errors"][name] = f"{type(exc).__name__}: {exc}"
            progress(f"[bench gpu] {name} FAILED: {exc}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        (a.output_dir / "bench_gpu.json").write_text(json.dumps(res, indent=1, default=str))

    def copy() -> list[dict]:
        src = torch.empty(((4 << 20) if a.smoke else (2 << 30)) // 4, device=device).normal_()
        dst = torch.empty_like(src)
        t = median_ms(lambda: dst.copy_(src), a.repeats, a.warmup)
        return [{"bytes": 2 * src.numel() * 4, "ms": t, "gb_per_s": 2 * src.numel() * 4 / t / 1e6}]

    if "copy" in want:
        section("copy", copy)
    copy_gbs = res["copy"][0]["gb_per_s"] if res.get("copy") else None
    for head in heads if "drafter" in want else ():
        for k in kernel_modes:
            section(f"drafter:{head}:{k}", lambda: section_drafter(a, head, device, dtype, k))
    model, drafter = build_target(target, device, dtype), build_head(heads[-1], device, dtype)
    if "peers" in want:  # first: bf16 weights as every peer's, before the FP8 conversion
        section("peers", lambda: section_peers(a, model, drafter, kern, graphs, copy_gbs, device, dtype))
    if "long-context" in want:
        section("long-context", lambda: section_long(a, model, drafter, kern, graphs, copy_gbs, device))
    steps = want & {"target", "iteration", "profile"}
    slots, max_len = max(a.batches), a.context + step_margin(a)
    for weights in ("bf16", "fp8") if steps or "fp8" in want else ():
        if weights == "fp8":
            if "fp8" not in want:
                break
            if device.type != "cuda":
                res["skipped"].append("target:fp8 (CPU smoke: no FP8 matmul timing on CPU)")
                break
            section("convert:fp8", lambda: to_fp8(model) or [])
            if "convert:fp8" in res["errors"] or "convert:fp8" in res["skipped"]:
                break  # never time a half-converted model under the fp8 label
        if weights == "bf16" and not steps:
            continue
        for k in kernel_modes:
            # off, then on (one run, one card): bf16 on the kernels the iteration uses
            for g in graph_modes if weights == "bf16" and k == kern else (False,):
                ex = TorchExecutor(model, drafter, slots, max_len, kernels=k, cuda_graphs=g)
                label = f"{weights}:{k}{':graphs' if g else ''}"
                if "target" in want or weights == "fp8":
                    section(f"target:{label}", lambda: section_target(a, ex, weights, copy_gbs))
                if weights == "bf16" and k == kern and "iteration" in want:
                    section(f"iteration:{label}", lambda: section_iteration(a, ex, device))
                if weights == "bf16" and k == kern and g == graphs and "profile" in want:
                    section(f"profile:{label}", lambda: section_profile(a, ex, device))  # where its time goes
                ex = None  # free this executor (and its graphs) before the next mode
    if "projection" in want:
        section("projection", lambda: section_projection(res))
    res.pop("convert", None)
    res["wall_s"], res["targets"] = round(time.monotonic() - t0, 1), check_targets(res)
    return finish(a, f"GPU benchmark ({'SMOKE run: tiny shapes, figures meaningless' if a.smoke else 'real shapes'})",
                  report(res, a), res, figures(res), res["machine"])
