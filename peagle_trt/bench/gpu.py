"""Suite `gpu` (docs/BENCHMARKS.md, "gpu"): the speculate-verify step at real shapes, random weights, on
the torch executor, timed with CUDA events (contenders alternated): `copy` (device copy bandwidth, the
MBU reference), `drafter` (P-EAGLE parallel vs EAGLE-3 sequential, K = 1..11, batch 1/16/64, GPT-OSS-20B
and Llama-3.1-8B P-EAGLE head shapes), `target` (Llama-3.1-8B-class decode and verify over a --context
KV cache, bf16 and FP8 weights, custom ops on the torch references and on the Triton kernels; MBU =
bytes read / copy bandwidth / time), `iteration` (one SpecDecoder.step minus its verify and draft
forwards, and its host syncs), `projection` (tokens/s from those times and acceptance lengths: a
PROJECTION, labelled). The report and issue 15's target checks: bench/gpu_report.py. --smoke runs
tiny shapes on CPU. Writes OUTPUT_DIR/bench_gpu.json after every section (a time-out keeps what
finished); OUTPUT_DIR defaults to $OUT, else gpu_results.
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
from peagle_trt.bench.gpu_report import report
from peagle_trt.bench.harness import alternate, device_clock, finish, machine, progress, summary
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
# Acceptance lengths (1 + sum of per-position rates) used by the projection when --acceptance is absent:
# PUBLISHED figures (vLLM / AWS P-EAGLE blog, GPT-OSS-20B, MT-Bench, B200), not measured here.
PUBLISHED_AL = {"peagle": {3: 2.87, 7: 3.70}, "eagle3": {3: 2.70, 7: 3.27},
                "source": "published: vLLM/AWS P-EAGLE blog, GPT-OSS-20B MT-Bench (not measured here)"}


def env_info(device: torch.device) -> dict:
    info = {"device": str(device), "cuda": torch.version.cuda, "triton_kernels": cuda_kernels.available()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, sm=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                    gpu_memory_gib=round(p.total_memory / 2**30, 1))
    return info


def timed(fn, device: torch.device, repeats: int, warmup: int) -> float:
    """Median milliseconds of `fn()` (CUDA events on a GPU, perf_counter on CPU)."""
    return summary(alternate({"fn": fn}, repeats, warmup, clock=device_clock)["fn"], 1e3)["median"]


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
    """Replace every decoder-layer nn.Linear by an FP8Linear (per-tensor E4M3, ModelOpt's layout),
    quantized from its own weights; lm_head and embeddings stay unquantized (as `peagle-trt quantize`)."""
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


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights one forward reads (the embedding table only gathers a few rows)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)


# -- sections ------------------------------------------------------------------------------------------
def section_copy(a, device) -> dict:
    n = a.copy_bytes // 4
    src = torch.empty(n, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), device, a.repeats * 2, a.warmup)
    return {"bytes": 2 * n * 4, "ms": ms, "gb_per_s": 2 * n * 4 / ms / 1e6}


class DrafterOnlyExecutor:
    """TorchExecutor's drafting methods over a drafter and its cache (no target needed to draft)."""

    draft_parallel, drafter = TorchExecutor.draft_parallel, TorchExecutor.drafter
    project, to_target_ids = TorchExecutor.project, TorchExecutor.to_target_ids

    def __init__(self, model: DrafterModel, slots: int, max_len: int, kernels: str):
        self.drafter_model, self.drafter_cache = model, model.new_cache(slots, max_len)
        self.mask_token_id, self.device = model.config.mask_token_id, model.fc.weight.device
        self._ops = cuda_kernels.routed if kernels == "cuda" else contextlib.nullcontext


def draft_batch(model, b: int, n: int, context: int, device) -> DraftBatch:
    """B sequences with n pending rows at positions context-n .. context-1 (padding none)."""
    c = model.config
    seqs = [Sequence([0], SamplingParams(), i, stats=SpecStats(1)) for i in range(b)]
    aux = torch.randn(b, n, c.num_aux * c.target_hidden_size, device=device, dtype=model.fc.weight.dtype)
    def full(v):
        return torch.full((b,), v, dtype=torch.long, device=device)

    return DraftBatch(seqs, torch.randint(0, c.vocab_size - 1, (b, n), device=device), aux, full(n),
                      full(context), torch.arange(b, device=device))


def section_drafter(a, device, dtype, kernels: str, head: str) -> list[dict]:
    model = build_head(head, device, dtype)
    ex = DrafterOnlyExecutor(model, max(a.batches), a.context + max(a.draft_ks) + 8, kernels)
    rows = []
    for b in a.batches:
        batch = draft_batch(model, b, 3, a.context, device)  # 2 accepted drafts + the bonus
        for k in a.draft_ks:
            t = alternate({"parallel": lambda: ParallelDrafter(ex).propose(batch, k),
                           "sequential": lambda: SequentialDrafter(ex).propose(batch, k)},
                          a.repeats, a.warmup, clock=device_clock)
            rows.append({"head": head, "kernels": kernels, "batch": b, "k": k,
                         "parallel_ms": summary(t["parallel"], 1e3)["median"],
                         "sequential_ms": summary(t["sequential"], 1e3)["median"]})
    ex = model = None  # free the head before the next section
    return rows


def target_forward(ex, b: int, s: int, context: int, device):
    tokens = torch.randint(0, 100, (b, s), device=device)
    positions = context + torch.arange(s, device=device)[None].expand(b, -1)  # [B, S]
    seqs = torch.arange(b, device=device)  # sequence indices: the static block layout (models/kv_cache.py)
    return lambda: ex.target(tokens, positions, seqs)


def section_target(a, ex, weights: str, copy_gbs: float, device) -> list[dict]:
    c, elem = ex.target_model.config, ex.target_cache.k[0].element_size()
    wbytes = weight_bytes(ex.target_model)
    rows = []
    for b in a.batches:
        for k in [0] + list(a.ks):  # 0 = decode (one row)
            ms = timed(target_forward(ex, b, k + 1, a.context, device), device, a.repeats, a.warmup)
            kv = b * c.num_layers * 2 * c.num_kv_heads * c.head_dim * (a.context + k + 1) * elem
            floor = (wbytes + kv) / (copy_gbs * 1e6) if copy_gbs else None
            rows.append({"weights": weights, "kernels": ex.kernels, "batch": b, "k": k,
                         "step": "decode" if k == 0 else "verify", "ms": ms, "weight_bytes": wbytes,
                         "kv_bytes": kv, "floor_ms": floor, "mbu": floor / ms if floor else None})
    return rows


def sequences(ex, b: int, k: int, context: int, vocab: int) -> list[Sequence]:
    """B decoding sequences at `context`, each holding the KV blocks of sequence i in the static
    layout (blocks i*M .. i*M + M - 1, what target_forward's sequence indices address), so a step
    reads and writes the same blocks as the verify timed alone."""
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    tables = ex.target_cache.tables(torch.arange(b, device=ex.device)).tolist()  # [G, B, M]
    out = []
    for i in range(b):
        s = Sequence([1] * context, params, i, stats=SpecStats(k), num_computed=context, cur=context,
                     blocks=[group[i] for group in tables])
        s.output, s.drafts = [2], [3 % vocab] * k
        out.append(s)
    return out


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
    rows, vocab = [], ex.target_model.config.vocab_size
    k = a.iter_k
    for mode in ("none", "eagle3", "peagle"):
        spec = SpecConfig(mode, k)
        decoder = SpecDecoder(ex, spec)
        for b in a.batches:
            seqs = sequences(ex, b, spec.k, a.context, vocab)
            step_ms = timed(lambda: decoder.step(seqs), device, a.repeats, a.warmup)
            verify_ms = timed(target_forward(ex, b, spec.k + 1, a.context, device), device, a.repeats, a.warmup)
            draft_ms = 0.0
            if spec.k:
                batch = DraftBatch(seqs, torch.zeros(b, 1, dtype=torch.long, device=device),
                                   torch.randn(b, 1, 3 * ex.target_model.config.hidden_size, device=device,
                                               dtype=ex.target_model.lm_head.weight.dtype),
                                   torch.ones(b, dtype=torch.long, device=device),
                                   torch.full((b,), a.context + 1, device=device),
                                   torch.arange(b, device=device))
                draft_ms = timed(lambda: decoder.proposer.propose(batch, k), device, a.repeats, a.warmup)
            syncs = count_syncs(lambda: decoder.step(seqs)) if device.type == "cuda" else None
            rows.append({"mode": mode, "k": spec.k, "batch": b, "kernels": ex.kernels, "step_ms": step_ms,
                         "verify_ms": verify_ms, "draft_ms": draft_ms,
                         "overhead_ms": step_ms - verify_ms - draft_ms,
                         "host_syncs": None if syncs is None else len(syncs),
                         "sync_examples": None if syncs is None else sorted(set(syncs))[:6]})
    return rows


def acceptance(path: Path | None) -> dict:
    """{mode: {K: AL}} from a JSON file of per-position rates ({"peagle": {"7": [p1..p7]}, ...}) or the
    published defaults."""
    if path is None:
        return PUBLISHED_AL
    raw = json.loads(Path(path).read_text())
    out = {m: {int(k): 1.0 + sum(rates) for k, rates in raw[m].items()} for m in ("peagle", "eagle3") if m in raw}
    out["source"] = f"measured per-position acceptance from {Path(path).name}"
    return out


def section_projection(results: dict, al: dict) -> list[dict]:
    """tokens/s = B * AL / (t_verify + t_draft + overhead); none = B / (t_decode + overhead)."""
    iters = {(r["mode"], r["batch"]): r for r in results.get("iteration", [])}
    verify = {(r["batch"], r["k"]): r["ms"] for r in results.get("target", [])
              if r["weights"] == "bf16" and r["kernels"] == results["kernels_used"]}
    drafts = {(r["batch"], r["k"]): r for r in results.get("drafter", [])  # the target's own head
              if r["head"] == results["heads"][-1] and r["kernels"] == results["kernels_used"]}
    rows = []
    for (mode, b), it in sorted(iters.items()):
        ks = [0] if mode == "none" else sorted(al.get(mode, {}))
        for k in ks:
            if (b, k) not in verify or (mode != "none" and (b, k) not in drafts):
                continue
            draft = 0.0 if mode == "none" else drafts[(b, k)]["parallel_ms" if mode == "peagle" else "sequential_ms"]
            length = 1.0 if mode == "none" else al[mode][k]
            ms = verify[(b, k)] + draft + it["overhead_ms"]
            rows.append({"mode": mode, "batch": b, "k": k, "acceptance_length": length,
                         "step_ms": ms, "tokens_per_s": b * length / ms * 1e3, "label": "PROJECTION"})
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget-s", type=float, default=300.0, help="skip the sections that start later")
    p.add_argument("--context", type=int, default=None, help="KV positions already cached (default 1024)")
    p.add_argument("--acceptance", type=Path, default=None, help="per-position rates JSON of a trained pair")


def run(a: argparse.Namespace) -> dict:
    """--smoke: tiny shapes, few repeats (CPU ok): proves the suite runs."""
    t0 = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not a.smoke:
        raise ConfigError("no CUDA device: the GPU benchmark needs one (torch.cuda.is_available() is False); "
                          "run it on an H100/H200 (scripts/gpu_validate.sh), or pass --smoke for the CPU smoke run")
    a.output_dir = a.output_dir or Path(os.environ.get("OUT") or "gpu_results")
    a.out = a.output_dir
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a.batches, a.ks, a.draft_ks = ((1, 2), (1, 3), (1, 3)) if a.smoke else ((1, 16, 64), (3, 7, 11), (1, 3, 7, 11))
    a.iter_k = 3 if a.smoke else 7
    a.context = a.context or (16 if a.smoke else 1024)
    a.repeats, a.warmup = (2, 1) if a.smoke else (10, 3)
    a.copy_bytes = (4 << 20) if a.smoke else (2 << 30)
    target, heads = ("tiny", ["tiny"]) if a.smoke else ("llama-3.1-8b", ["gpt-oss-20b-peagle", "llama-3.1-8b-peagle"])
    kernel_modes = ["reference"] + (["cuda"] if device.type == "cuda" and cuda_kernels.available() else [])
    results = {"smoke": a.smoke, "env": env_info(device), "machine": machine(a.smoke), "target_shape": target,
               "heads": heads,
               "assumed": {h: ASSUMED.get(h) for h in heads}, "context": a.context, "dtype": str(dtype),
               "kernels_used": kernel_modes[-1], "kernel_modes": kernel_modes, "skipped": [], "errors": {},
               "acceptance_source": None}
    a.out.mkdir(parents=True, exist_ok=True)

    def run(name: str, fn):
        if time.monotonic() - t0 > a.budget_s:
            results["skipped"].append(name)
            progress(f"[bench gpu] {name}: skipped (budget {a.budget_s:.0f} s spent)")
            return
        progress(f"[bench gpu] {name} ...")
        try:
            out = fn()
            if out is not None:
                results.setdefault(name.split(":")[0], []).extend(out if isinstance(out, list) else [out])
        except Exception as exc:  # a failed section must not lose the others: recorded, reported
            results["errors"][name] = f"{type(exc).__name__}: {exc}"
            progress(f"[bench gpu] {name} FAILED: {exc}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        (a.out / "bench_gpu.json").write_text(json.dumps(results, indent=1, default=str))

    run("copy", lambda: section_copy(a, device))
    copy_gbs = results["copy"][0]["gb_per_s"] if results.get("copy") else None
    for head in heads:
        for kern in kernel_modes:
            run(f"drafter:{head}:{kern}", lambda: section_drafter(a, device, dtype, kern, head))
    model = build_target(target, device, dtype)
    drafter = build_head(heads[-1], device, dtype)
    slots, max_len = max(a.batches), a.context + 64 + (a.repeats + a.warmup) * 3 * 2
    for weights in ("bf16", "fp8"):
        if weights == "fp8":
            if device.type != "cuda":
                results["skipped"].append("target:fp8 (CPU smoke: no FP8 matmul timing on CPU)")
                break
            run("convert:fp8", lambda: to_fp8(model))
            if "convert:fp8" in results["errors"] or "convert:fp8" in results["skipped"]:
                break  # never time a half-converted model under the fp8 label
        for kern in kernel_modes:
            ex = TorchExecutor(model, drafter, slots, max_len, kernels=kern)
            run(f"target:{weights}:{kern}", lambda: section_target(a, ex, weights, copy_gbs, device))
            if weights == "bf16" and kern == kernel_modes[-1]:
                run("iteration", lambda: section_iteration(a, ex, device))
            ex = None  # free this executor before the next kernels mode
    al = acceptance(a.acceptance)
    results["acceptance_source"] = al["source"]
    run("projection", lambda: section_projection(results, al))
    results["wall_s"] = round(time.monotonic() - t0, 1)
    (a.out / "bench_gpu.json").write_text(json.dumps(results, indent=1, default=str))
    sections, figures, summary_keys = report(results, a)
    return finish(a, f"GPU benchmark ({'SMOKE run: tiny shapes, figures meaningless' if a.smoke else 'real shapes'})",
                  sections, {**results, **summary_keys}, figures, results["machine"])
