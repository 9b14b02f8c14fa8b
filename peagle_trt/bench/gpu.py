"""Suites `gpu` and `drafter` (docs/BENCHMARKS.md, one section each): the speculate-verify step at real
shapes, random weights, torch executor, CUDA events. `gpu`: copy bandwidth (the MBU reference), drafting
(parallel vs sequential), decode and verify (bf16, FP8; torch references and Triton kernels), the
iteration overhead and its host syncs, a PROJECTION of tokens/s from published acceptance lengths,
issue 15's targets; on CUDA the bf16 forwards and the iteration with CUDA graphs off and on, in the one run
(executors/graphs.py; the projection and the targets read the graphs-on figures); OUTPUT_DIR (default
$OUT, else gpu_results)/bench_gpu.json is rewritten after every section; --smoke: tiny shapes on CPU.
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
from peagle_trt.bench.decode import model_costs
from peagle_trt.bench.forwards import forward
from peagle_trt.bench.harness import (
    Figure,
    alternate,
    device_clock,
    finish,
    int_list,
    lines,
    machine,
    median_ms,
    options,
    progress,
    records,
    series,
    summary,
)
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
# Acceptance lengths of the projection: PUBLISHED, not measured here
PUBLISHED_AL = {"peagle": {3: 2.87, 7: 3.70}, "eagle3": {3: 2.70, 7: 3.27}}
AL_SOURCE = "published: vLLM/AWS P-EAGLE blog, GPT-OSS-20B MT-Bench (not measured here)"
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


def section_target(a, ex, weights: str, copy_gbs: float) -> list[dict]:
    """Decode (k = 0: one row) and verify (k + 1 rows); floor = bytes read / the copy bandwidth."""
    costs, rows = model_costs(ex.target_model), []
    for b in a.batches:
        for k in [0] + list(a.ks):
            t = median_ms(forward(ex, b, k + 1, a.context), a.repeats, a.warmup)
            read = costs["weight_bytes"] + b * costs["kv_bytes_per_pos"] * (a.context + k + 1)
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


def section_iteration(a, ex, device) -> list[dict]:
    """One SpecDecoder.step minus its verify and draft forwards (timed alone), per mode and batch; each
    sequence holds the blocks of the static layout that `forward` addresses."""
    rows, hidden = [], ex.target_model.config.hidden_size
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    for mode in ("none", "eagle3", "peagle"):
        spec = SpecConfig(mode, a.iter_k)
        decoder = SpecDecoder(ex, spec)
        for b in a.batches:
            tables = ex.target_cache.tables(torch.arange(b, device=ex.device)).tolist()  # [G, B, M]
            seqs = [Sequence([1] * a.context, params, i, stats=SpecStats(spec.num_spec_tokens), num_computed=a.context,
                             cur=a.context, blocks=[group[i] for group in tables]) for i in range(b)]
            for s in seqs:
                s.output, s.drafts = [2], [3] * spec.num_spec_tokens
            step_ms = median_ms(lambda: decoder.step(seqs), a.repeats, a.warmup)
            verify_ms = median_ms(forward(ex, b, spec.num_spec_tokens + 1, a.context), a.repeats, a.warmup)
            draft_ms = 0.0
            if spec.num_spec_tokens:
                def full(v):
                    return torch.full((b,), v, dtype=torch.long, device=device)
                batch = DraftBatch(seqs, full(0)[:, None], torch.randn(b, 1, 3 * hidden, device=device,
                                   dtype=ex.target_model.lm_head.weight.dtype), full(1), full(a.context + 1),
                                   torch.arange(b, device=device))
                draft_ms = median_ms(lambda: decoder.proposer.propose(batch, spec.num_spec_tokens), a.repeats, a.warmup)
            # one expected (issue 57): the read of the accepted tokens; the verify's host ints go up
            # non-blocking from pinned memory (speculative/drafting.py upload). 5 on the H200 of 2026-11-28,
            # before that upload (4 synchronous copies + the read)
            syncs = count_syncs(lambda: decoder.step(seqs)) if device.type == "cuda" else None
            rows.append({"mode": mode, "k": spec.num_spec_tokens, "batch": b, "kernels": ex.kernels,
                         "graphs": ex.graphs is not None, "step_ms": step_ms,
                         "verify_ms": verify_ms, "draft_ms": draft_ms, "overhead_ms": step_ms - verify_ms - draft_ms,
                         "host_syncs": None if syncs is None else len(syncs),
                         "sync_examples": None if syncs is None else sorted(set(syncs))[:6]})
    return rows


def profile_rows(fn, what: str, top: int = 12) -> list[dict]:
    """torch.profiler over `fn()`: its `top` device kernels by total time (count, us), its `top` host ops
    by self time, and the number of kernels it launched. Where a graph-replayed forward spends its time
    (kernels) and where the step's host time goes (ops): what the next change should fuse or remove."""
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
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    spec = SpecConfig("peagle", a.iter_k)
    decoder = SpecDecoder(ex, spec)
    for b in (min(a.batches), max(a.batches)):
        tables = ex.target_cache.tables(torch.arange(b, device=ex.device)).tolist()  # [G, B, M]
        seqs = [Sequence([1] * a.context, params, i, stats=SpecStats(spec.num_spec_tokens), num_computed=a.context,
                         cur=a.context, blocks=[group[i] for group in tables]) for i in range(b)]
        for s in seqs:
            s.output, s.drafts = [2], [3] * spec.num_spec_tokens
        rows += profile_rows(lambda: decoder.step(seqs), f"peagle step K={spec.num_spec_tokens}, batch {b}")
    return rows


def section_projection(res: dict) -> list[dict]:
    """tokens/s = B * AL / (t_verify + t_draft + overhead); none: B / (t_decode + overhead); AL published."""
    al = PUBLISHED_AL
    kern, graphs = res["kernels_used"], res.get("graphs_used", False)
    verify = {(r["batch"], r["k"]): r["ms"] for r in res.get("target", [])
              if r["weights"] == "bf16" and r["kernels"] == kern and r.get("graphs", False) == graphs}
    drafts = {(r["batch"], r["k"]): r for r in res.get("drafter", [])  # the target's own head
              if r["head"] == res["heads"][-1] and r["kernels"] == kern}
    rows = []
    for it in res.get("iteration", []):
        if it.get("graphs", False) != graphs:
            continue
        mode, b = it["mode"], it["batch"]
        for k in [0] if mode == "none" else sorted(al.get(mode, {})):
            if (b, k) not in verify or (mode != "none" and (b, k) not in drafts):
                continue
            draft = 0.0 if mode == "none" else drafts[(b, k)]["parallel_ms" if mode == "peagle" else "sequential_ms"]
            length = 1.0 if mode == "none" else al[mode][k]
            step = verify[(b, k)] + draft + it["overhead_ms"]
            rows.append({"mode": mode, "batch": b, "k": k, "acceptance_length": length, "step_ms": step,
                         "tokens_per_s": b * length / step * 1e3, "label": "PROJECTION"})
    return rows


def check_targets(res: dict) -> list[dict]:
    """Issue 15's targets on what was measured (value None when a figure is missing)."""
    def one(rows, **want):
        return next((r for r in res.get(rows, []) if all(r.get(k) == v for k, v in want.items())), None)

    kern, head = res["kernels_used"], res["heads"][0]
    p1, p7 = (one("drafter", head=head, kernels=kern, batch=1, k=k) for k in (1, 7))
    fp8 = one("target", weights="fp8", kernels=kern, batch=1, k=7)
    it1, it64 = (one("iteration", mode="peagle", batch=b, graphs=res.get("graphs_used", False)) for b in (1, 64))
    checks = [("parallel draft K=7 / K=1 (batch 1)", p7 and p1 and p7["parallel_ms"] / p1["parallel_ms"], "<=", 1.2),
              ("sequential K=7 / parallel K=7 (batch 1)", p7 and p7["seq_over_par"], ">=", 4.0),
              ("FP8 verify K=7 batch 1: fraction of the bandwidth floor", fp8 and fp8["mbu"], ">=", 0.7),
              ("iteration overhead, peagle, batch 1 (ms)", it1 and it1["overhead_ms"], "<=", 0.3),
              ("iteration overhead, peagle, batch 64 (ms)", it64 and it64["overhead_ms"], "<=", 1.0)]
    return [{"target": name, "goal": f"{op} {goal}", "value": None if v is None else round(v, 3),
             "met": None if v is None else (v <= goal if op == "<=" else v >= goal)} for name, v, op, goal in checks]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget-s", type=float, default=300.0, help="gpu: skip the sections that start later")
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
    figures = [Figure(f"drafting step, {r['head']} head, P-EAGLE K={k} over K=1", r["par_over_par_k1"], "x", "<= 1.5x")
               for r in rows if r["k"] == k and r["par_over_par_k1"]]
    figures += [Figure(f"drafting step, {r['head']} head, K={k}: EAGLE-3 over P-EAGLE", r["seq_over_par"], "x")
                for r in rows if r["k"] == k]
    return finish(args, "Drafter forward: P-EAGLE parallel vs EAGLE-3 sequential", [
        f"Drafting step, batch 1, context {args.context}, 3 pending rows: median ms",
        records(rows, ["head", "k", "parallel_ms", "sequential_ms", "seq_over_par", "par_over_par_k1"])],
        {"context": args.context, "batch": 1, "dtype": "float32", "rows": rows,
         "heads": {h: {"config": {k: str(v) for k, v in HEADS[h].items()}, "assumed": ASSUMED.get(h)} for h in heads}},
        figures)


def run(a: argparse.Namespace) -> dict:
    if a.suite == "drafter":
        return run_drafter(a)
    t0 = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not a.smoke:
        raise ConfigError("no CUDA device: the GPU benchmark needs one (torch.cuda.is_available() is False); "
                          "run it on an H100/H200 (scripts/gpu_validate.sh), or pass --smoke for the CPU smoke run")
    a.output_dir = a.output_dir or Path(os.environ.get("OUT") or "gpu_results")
    a.output_dir.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a.batches, a.ks, a.draft_ks = ((1, 2), (1, 3), (1, 3)) if a.smoke else ((1, 16, 64), (3, 7, 11), (1, 3, 7, 11))
    a.iter_k, a.context = (3, a.context or 16) if a.smoke else (7, a.context or 1024)
    a.repeats, a.warmup = (2, 1) if a.smoke else (10, 3)
    target, heads = ("tiny", ["tiny"]) if a.smoke else ("llama-3.1-8b", ["gpt-oss-20b-peagle", "llama-3.1-8b-peagle"])
    kernel_modes = ["reference"] + (["cuda"] if device.type == "cuda" and cuda_kernels.available() else [])
    graph_modes = (False, True) if device.type == "cuda" and not a.no_cuda_graphs else (False,)
    env = {"device": str(device), "cuda": torch.version.cuda, "triton_kernels": cuda_kernels.available()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, sm=f"{p.major}.{p.minor}", gpu_memory_gib=round(p.total_memory / 2**30, 1))
    res = {"smoke": a.smoke, "env": env, "device": env.get("gpu", env["device"]), "machine": machine(a.smoke),
           "target_shape": target, "heads": heads, "assumed": {h: ASSUMED.get(h) for h in heads},
           "context": a.context, "dtype": str(dtype), "kernels_used": kernel_modes[-1], "graphs_used": graph_modes[-1],
           "kernel_modes": kernel_modes, "skipped": [], "errors": {}}

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

    section("copy", copy)
    copy_gbs = res["copy"][0]["gb_per_s"] if res.get("copy") else None
    for head in heads:
        for kern in kernel_modes:
            section(f"drafter:{head}:{kern}", lambda: section_drafter(a, head, device, dtype, kern))
    model, drafter = build_target(target, device, dtype), build_head(heads[-1], device, dtype)
    slots, max_len = max(a.batches), a.context + 64 + (a.repeats + a.warmup) * 3 * 2
    for weights in ("bf16", "fp8"):
        if weights == "fp8":
            if device.type != "cuda":
                res["skipped"].append("target:fp8 (CPU smoke: no FP8 matmul timing on CPU)")
                break
            section("convert:fp8", lambda: to_fp8(model) or [])
            if "convert:fp8" in res["errors"] or "convert:fp8" in res["skipped"]:
                break  # never time a half-converted model under the fp8 label
        for kern in kernel_modes:
            # off, then on (one run, one card): bf16 on the kernels the iteration uses
            for graphs in graph_modes if weights == "bf16" and kern == kernel_modes[-1] else (False,):
                ex = TorchExecutor(model, drafter, slots, max_len, kernels=kern, cuda_graphs=graphs)
                label = f"{weights}:{kern}{':graphs' if graphs else ''}"
                section(f"target:{label}", lambda: section_target(a, ex, weights, copy_gbs))
                if weights == "bf16" and kern == kernel_modes[-1]:
                    section(f"iteration:{label}", lambda: section_iteration(a, ex, device))
                    if graphs == graph_modes[-1]:  # the product's configuration: where its time goes
                        section(f"profile:{label}", lambda: section_profile(a, ex, device))
                ex = None  # free this executor (and its graphs) before the next mode
    section("projection", lambda: section_projection(res))
    res.pop("convert", None)
    res["wall_s"], res["targets"] = round(time.monotonic() - t0, 1), check_targets(res)
    return finish(a, f"GPU benchmark ({'SMOKE run: tiny shapes, figures meaningless' if a.smoke else 'real shapes'})",
                  report(res, a), res, [Figure(f"GPU {t['target']}", t["value"], "", t["goal"], 3)
                                        for t in res["targets"] if t["value"] is not None], res["machine"])


def report(res: dict, a) -> list[str]:
    env, kern = res["env"], res["kernels_used"]
    out = [f"device {env['device']}: {env.get('gpu', 'CPU')} (sm {env.get('sm')}), CUDA {env['cuda']}; random "
           f"weights, {res['dtype']}; target {res['target_shape']}, heads {res['heads']}, context {res['context']}; "
           f"custom ops: {res['kernel_modes']}; assumed: {[v for v in res['assumed'].values() if v]}",
           "### Targets (issue 15)", records(res["targets"], ["target", "goal", "value", "met"]),
           "### Drafting step, parallel (one pass) vs sequential (K passes), ms",
           records(res.get("drafter", []), ["head", "kernels", "batch", "k", "parallel_ms", "sequential_ms",
                                            "seq_over_par"]),
           "### Target forward: decode (k = 0) and verify (k + 1 rows), ms and MBU",
           records(res.get("target", []), ["weights", "kernels", "graphs", "batch", "k", "ms", "floor_ms", "mbu"]),
           "### Iteration overhead: one SpecDecoder.step minus its verify and draft forwards, ms",
           records(res.get("iteration", []), ["mode", "graphs", "k", "batch", "step_ms", "verify_ms", "draft_ms",
                                              "overhead_ms", "host_syncs", "sync_examples"]),
           "### Profiles (torch.profiler): kernels by device time, host ops by self time, us",
           records(res.get("profile", []), ["what", "kind", "name", "calls", "us"]),
           f"### PROJECTION: end-to-end tokens/s (acceptance: {AL_SOURCE})",
           records(res.get("projection", []), ["mode", "batch", "k", "acceptance_length", "step_ms", "tokens_per_s"]),
           "\n".join([f"- skipped: {s}" for s in res["skipped"]] + [f"- FAILED {k}: {v}" for k, v in
                                                                     res["errors"].items()])]
    drafts = [r for r in res.get("drafter", []) if r["head"] == res["heads"][0] and r["kernels"] == kern]
    drafting = {**series(drafts, "k", "parallel_ms", lambda r: f"parallel B={r['batch']}"),
                **series(drafts, "k", "sequential_ms", lambda r: f"sequential B={r['batch']}")}
    forwards = series([r for r in res.get("target", []) if r["kernels"] == kern], lambda r: r["k"] + 1, "ms",
                      lambda r: f"{r['weights']}{' graphs' if r.get('graphs') else ''} B={r['batch']}")
    return out + [lines(a, "", [(f"drafter {res['heads'][0]}", "K (draft tokens)", "ms per drafting step", drafting),
                                (res["target_shape"], "rows per sequence (1 = decode)", "ms per target forward",
                                 forwards)])]
