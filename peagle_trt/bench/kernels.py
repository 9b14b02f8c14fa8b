"""Suite `kernels` (docs/BENCHMARKS.md, "kernels"): the P-EAGLE Triton kernels (peagle_trt/ops/triton_kernels,
JIT through peagle_trt.ops.kernels) on a GPU, CUDA events: KV attention of a Llama-3-8B-like layer (H=32,
KV=8, d=128) at verify (K+1 = 8) and drafter (P+K-1 = 14) rows, batch 1/8/32, context 512-8192, its KV
blocks scattered over the paged cache; the draft sampler. Bytes read over the time: the bandwidth, and
its share of the GPU's datasheet HBM peak. Needs CUDA and triton (else a ConfigError naming what is missing).
"""

from __future__ import annotations

import argparse

import torch

from peagle_trt.bench.harness import HBM_PEAK, Figure, finish, median_ms, progress, records
from peagle_trt.config import BLOCK_SIZE
from peagle_trt.errors import ConfigError
from peagle_trt.ops import kernels as plugins


def roofline(gbps: float) -> float | None:
    """Achieved / peak HBM bandwidth of this GPU (None when its peak is not in HBM_PEAK)."""
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in HBM_PEAK.items() if k in name), None)
    return None if peak is None else round(gbps * 1e9 / peak, 3)


def attention_case(b, s, ctx, h, kv, d, dtype, fp8, iters, block_size=BLOCK_SIZE):
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    q = torch.randn(b, s, h * d, device="cuda", dtype=dtype)
    k = torch.randn(b, s, kv * d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    positions = (torch.arange(s, device="cuda") + ctx - s + 1).expand(b, s).contiguous()
    m = -(-(ctx + 1) // block_size)  # table entries covering positions 0 .. ctx
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(b * m, generator=gen).view(b, m).to("cuda")  # scattered blocks
    kc = torch.randn(b * m + 1, block_size, kv, d, device="cuda").to(cache_dtype)  # + the trash block
    vc = torch.randn(b * m + 1, block_size, kv, d, device="cuda").to(cache_dtype)
    extra = dict(k_scale=0.05, v_scale=0.05) if fp8 else {}
    ms = median_ms(lambda: plugins.kv_attention(q, k, v, positions, tables, kc, vc, h, kv, d, **extra), iters, 3)
    kv_bytes = 2 * b * kv * (ctx + 1) * d * kc.element_size()
    return dict(op="kv_attention", batch=b, rows=s, context=ctx, heads=h, kv_heads=kv, head_dim=d,
                dtype=str(dtype), fp8_cache=fp8, ms=round(ms, 4), kv_gbps=round(kv_bytes / ms / 1e6, 1),
                roofline=roofline(kv_bytes / ms / 1e6))


def sample_case(rows, vocab, iters):
    logits = torch.randn(rows, vocab, device="cuda")
    d2t = torch.zeros(vocab, dtype=torch.int64, device="cuda")
    ms = median_ms(lambda: plugins.draft_sample(logits, d2t), iters, 3)
    gbps = logits.numel() * 4 / ms / 1e6
    return dict(op="draft_sample", rows=rows, vocab=vocab, ms=round(ms, 4), gbps=round(gbps, 1),
                roofline=roofline(gbps))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    ap.add_argument("--fp8", action="store_true", help="FP8 (E4M3) KV cache")
    ap.add_argument("--iters", type=int, default=50, help="timed iterations per case (median reported)")


def run(args: argparse.Namespace) -> dict:
    if not torch.cuda.is_available():
        raise ConfigError("no CUDA device: the kernel benchmark times the kernels on a GPU "
                          "(torch.cuda.is_available() is False)")
    if not plugins.available():
        raise ConfigError("the Triton kernels are unavailable: pip install -c constraints.txt -e '.[dev]' "
                          "(triton==3.9.0)")
    dtype = getattr(torch, args.dtype)
    batches, contexts, samples = (1, 8, 32), (512, 2048, 8192), ((7, 32000), (56, 201088), (224, 151936))
    if args.smoke:  # batch 1, one context, the smallest vocabulary, 5 iterations
        batches, contexts, samples, args.iters = (1,), (512,), ((7, 32000),), 5
    results = []
    for b in batches:
        for s in (8, 14):  # verify (K=7) and drafter (P=8, K=7) rows
            for ctx in contexts:
                r = attention_case(b, s, ctx, 32, 8, 128, dtype, args.fp8, args.iters)
                progress(f"kv_attention b={b:3d} s={s:3d} ctx={ctx:5d}: {r['ms']:.4f} ms  {r['kv_gbps']:8.1f} GB/s")
                results.append(r)
    for rows, vocab in samples:
        r = sample_case(rows, vocab, args.iters)
        progress(f"draft_sample rows={rows:3d} vocab={vocab}: {r['ms']:.4f} ms  {r['gbps']:8.1f} GB/s")
        results.append(r)
    device = torch.cuda.get_device_name()
    attn = [r for r in results if r["op"] == "kv_attention"]
    big = max(attn, key=lambda r: (r["batch"], r["context"], -r["rows"]))
    figures = [Figure(f"kv_attention kernel, batch {big['batch']} x {big['rows']} rows, context {big['context']}: "
                      "share of the HBM peak", big["roofline"], "", "", 3)] if big["roofline"] is not None else []
    return finish(args, f"Triton kernels on {device} ({args.dtype}{', FP8 KV cache' if args.fp8 else ''}), median "
                  f"of {args.iters} iterations", [
                      records(attn, ["op", "batch", "rows", "context", "ms", "kv_gbps", "roofline"], 4),
                      records([r for r in results if r["op"] == "draft_sample"],
                              ["op", "rows", "vocab", "ms", "gbps", "roofline"], 4)],
                  {"device": device, "results": results}, figures)
