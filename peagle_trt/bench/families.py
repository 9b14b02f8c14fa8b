"""Suite `families` (docs/BENCHMARKS.md, "families"): real-width layer slices of the MoE targets on CPU
(random fp32 weights, our decoder layers and KV cache) at position 4096: one decode (1 row), verify
(K+1 = 8 rows) and prefill chunk (128 rows), alternated, wall and process-CPU ms; one expert MLP for 1
and 8 rows. Computed, not measured: the bytes one decode / verify step of the FULL model reads and its
bandwidth floor on H200 / B200 (a projection). --smoke is --bytes-only (the slices need several GB).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from peagle_trt.bench.harness import HBM_PEAK, Figure, alternate, finish, progress, records, summary
from peagle_trt.bench.seed_models import GPT_OSS_20B, QWEN3_CODER_30B_A3B  # the published configs
from peagle_trt.checkpoint.adapters import adapter_for
from peagle_trt.config import BLOCK_SIZE
from peagle_trt.models.kv_cache import KVCache
from peagle_trt.models.rope import inv_freq, rope_cos_sin
from peagle_trt.models.target import decoder_layer
from peagle_trt.ops import reference

# name -> (config, layers in the CPU slice, weight format, bytes per expert / attention weight value):
# Qwen3-Coder as FP8 everywhere but lm_head (the P-EAGLE headline setting), GPT-OSS as released
# (MXFP4 experts: 4 bits + one 8-bit scale per 32 values; attention in bf16)
MODELS = {"qwen3-coder-30b-a3b": (QWEN3_CODER_30B_A3B, 1, "fp8 experts + attention", 1.0, 1.0),
          "gpt-oss-20b": (GPT_OSS_20B, 2, "mxfp4 experts, bf16 attention", 4.25 / 8, 2.0)}
BANDWIDTH = {gpu: HBM_PEAK[gpu] for gpu in ("H200", "B200")}  # the projection's GPUs
CONTEXT, K = 4096, 7
DTYPE = torch.float32  # CPU compute in fp32: a bf16 trial ran 8-row expert GEMMs ~200x slower than 1-row ones


def timed(fns: dict, reps: int) -> dict:
    """Median wall and process-CPU ms of each fn, alternated (CPU time is less sensitive to a loaded machine)."""
    cpu: dict = {n: [] for n in fns}

    def with_cpu(name, fn):
        def go():
            c0 = time.process_time()
            fn()
            cpu[name].append(time.process_time() - c0)
        return go

    wall = alternate({n: with_cpu(n, fn) for n, fn in fns.items()}, reps)
    return {n: {"wall_ms": round(summary(wall[n], 1e3)["median"], 3),
                "cpu_ms": round(summary(cpu[n][-reps:], 1e3)["median"], 3)} for n in fns}


@torch.inference_mode()
def bench_slice(cfg: dict, layers: int, reps: int) -> dict:
    where = f"{cfg['model_type']} config"
    c = adapter_for(cfg, where).parse(cfg, where)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    torch.manual_seed(0)
    with torch.device("meta"):
        mods = [decoder_layer(c, i) for i in range(layers)]
    mods = [m.to_empty(device="cpu").to(DTYPE) for m in mods]
    for m in mods:
        for p in m.parameters():
            p.normal_(0, 0.02)
    weight_bytes = sum(p.numel() * p.element_size() for m in mods for p in m.parameters())
    max_len = CONTEXT + 256
    shapes = tuple((c.attention(i).num_kv_heads, c.attention(i).head_dim) for i in range(layers))
    cache = KVCache(shapes, (0,) * layers, (KVCache.static_blocks(1, max_len, BLOCK_SIZE),), BLOCK_SIZE, max_len, DTYPE)
    inv, scale = inv_freq(c.rope, c.head_dim)
    slots = cache.tables(torch.tensor([0]))  # block tables of one request

    def step(rows: int):
        pos = torch.arange(CONTEXT, CONTEXT + rows)[None]
        x0 = torch.randn(1, rows, c.hidden_size, dtype=DTYPE)
        cos, sin = rope_cos_sin(inv, scale, pos, DTYPE)

        def run():
            x = x0
            for i, m in enumerate(mods):
                x = m(x, cos, sin, cache, i, slots, pos)
        return run

    out = {"layers_in_slice": layers, "layer_windows": [c.window(i) for i in range(layers)],
           "weight_gib": round(weight_bytes / 2 ** 30, 3),
           "step": timed({f"{n}_rows": step(n) for n in (1, K + 1, 128)}, reps)}
    moe = next(m.mlp for m in mods if hasattr(m.mlp, "experts"))
    w13, w2 = moe.experts.gate_up_proj[0], moe.experts.down_proj[0]  # expert 0 of the stacked experts

    def expert(x):  # its gate/up, activation and down (peagle_trt/ops/reference.py)
        gate, up = torch.nn.functional.linear(x, w13).chunk(2, dim=-1)
        return torch.nn.functional.linear(reference.moe_act(gate, up, moe.cfg.activation), w2)
    xs = {n: torch.randn(n, c.hidden_size, dtype=DTYPE) for n in (1, K + 1)}
    out["one_expert"] = timed({f"{n}_rows": (lambda x=x: expert(x)) for n, x in xs.items()}, reps * 4)
    out["rss_gib_increase"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20 - rss0, 3)
    return out


def step_bytes(cfg: dict, expert_bytes: float, attn_bytes: float, rows: int, context: int = CONTEXT) -> dict:
    """Bytes one target forward of `rows` rows of ONE sequence reads (full model, batch 1):
    expert / attention weights at `expert_bytes` / `attn_bytes` per value, router, lm_head and
    KV in bf16. Experts
    touched: E * (1 - (1 - k/E)^rows), the expectation under uniform independent routing (an
    assumption: real routing is skewed, which touches fewer)."""
    where = f"{cfg['model_type']} config"
    c = adapter_for(cfg, where).parse(cfg, where)
    h, d, e, k = c.hidden_size, c.head_dim, c.moe.num_experts, c.moe.top_k
    attn = (h * c.num_heads * d * 2 + h * c.num_kv_heads * d * 2) * attn_bytes  # q, o, k, v
    touched = e * (1 - (1 - k / e) ** rows)
    experts = touched * 3 * h * c.moe.intermediate_size * expert_bytes
    router = e * h * 2
    kv = sum(2 * c.num_kv_heads * d * 2 * min(context, c.window(i) or context) for i in range(c.num_layers))
    per_layer = attn + router + experts
    lm_head = c.vocab_size * h * 2
    total = c.num_layers * per_layer + lm_head + kv + rows * h * 2
    return {"rows": rows, "experts_touched_per_layer": round(touched, 2),
            "weights_gib": round((c.num_layers * per_layer + lm_head) / 2 ** 30, 3),
            "kv_gib": round(kv / 2 ** 30, 4), "total_gib": round(total / 2 ** 30, 3),
            **{f"{gpu}_floor_us (projection)": round(total / bw * 1e6, 1) for gpu, bw in BANDWIDTH.items()}}


SMOKE = dict(bytes_only=True, reps=1)  # the real-width slices need several GB even once


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions of each step")
    parser.add_argument("--bytes-only", action="store_true", help="only the computed bytes per step")


def sections(result: dict) -> list[str]:
    """The markdown tables: the measured CPU slices, then the computed bytes per step."""
    slices = [{"model": name, "layers": r["cpu_slice"]["layers_in_slice"], "step": what, **t}
              for name, r in result.items() if r["cpu_slice"]
              for what, t in [*r["cpu_slice"]["step"].items(),
                              *((f"one expert, {k}", v) for k, v in r["cpu_slice"]["one_expert"].items())]]
    steps = [{"model": name, "format": r["expert_format"], **b}
             for name, r in result.items() for b in r["full_model_bytes_per_step"]]
    return ["### Layer slices, measured (median ms)" if slices else "",
            records(slices, ["model", "layers", "step", "wall_ms", "cpu_ms"], 1),
            "### Bytes per decode / verify step of the full model, computed (batch 1)",
            records(steps, list(steps[0]), 4)]


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(2)
    result = {}
    for name, (cfg, layers, fmt, expert_bytes, attn_bytes) in MODELS.items():
        progress(f"[families] {name} ...")
        result[name] = {"cpu_slice": bench_slice(cfg, layers, args.reps) if not args.bytes_only else None,
                        "full_model_bytes_per_step": [step_bytes(cfg, expert_bytes, attn_bytes, n)
                                                      for n in (1, K + 1)],
                        "expert_format": fmt}
    figures = [Figure(f"{name} layer slice ({r['cpu_slice']['layers_in_slice']}), decode step, CPU fp32",
                      r["cpu_slice"]["step"]["1_rows"]["wall_ms"], "ms", "", 1)
               for name, r in result.items() if r["cpu_slice"]]
    return finish(args, f"MoE targets on CPU (fp32, position {CONTEXT}, 2 threads)", sections(result),
                  {**result, "dtype": str(DTYPE), "context_position": CONTEXT}, figures)
