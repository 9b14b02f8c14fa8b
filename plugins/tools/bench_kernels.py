"""Time the P-EAGLE kernels on the GPU (CUDA events) and print achieved KV bandwidth.

    python plugins/tools/bench_kernels.py [--dtype bfloat16] [--fp8] [--iters 50]

Shapes: a Llama-3-8B-like layer (H=32, KV=8, d=128); verify rows S = K+1 = 8 and drafter rows
S = P+K-1; batch 1/8/32; every request at the same context length (512 .. 8192). The KV bytes read
(context x KV x d x 2 tensors) over the time gives the bandwidth to compare with the HBM peak
(H200: ~4.8 TB/s). The last stdout line is one JSON object with every measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from peagle_trt.ops import kernels as plugins  # noqa: E402


def bench(fn, iters: int) -> float:
    """Median milliseconds of fn() over iters runs (after warm-up)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def attention_case(b, s, ctx, h, kv, d, dtype, fp8, iters):
    t1 = ctx + s + 1
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    q = torch.randn(b, s, h * d, device="cuda", dtype=dtype)
    k = torch.randn(b, s, kv * d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    positions = (torch.arange(s, device="cuda") + ctx - s + 1).expand(b, s).contiguous()
    slots = torch.arange(b, device="cuda")
    kc = torch.randn(b, kv, t1, d, device="cuda").to(cache_dtype)
    vc = torch.randn(b, kv, t1, d, device="cuda").to(cache_dtype)
    extra = dict(k_scale=0.05, v_scale=0.05) if fp8 else {}
    ms = bench(lambda: plugins.kv_attention(q, k, v, positions, slots, kc, vc, h, kv, d, **extra), iters)
    kv_bytes = 2 * b * kv * (ctx + 1) * d * kc.element_size()
    return dict(op="kv_attention", batch=b, rows=s, context=ctx, heads=h, kv_heads=kv, head_dim=d,
                dtype=str(dtype), fp8_cache=fp8, ms=round(ms, 4), kv_gbps=round(kv_bytes / ms / 1e6, 1))


def sample_case(rows, vocab, iters):
    logits = torch.randn(rows, vocab, device="cuda")
    d2t = torch.zeros(vocab, dtype=torch.int64, device="cuda")
    ms = bench(lambda: plugins.draft_sample(logits, d2t), iters)
    return dict(op="draft_sample", rows=rows, vocab=vocab, ms=round(ms, 4),
                gbps=round(logits.numel() * 4 / ms / 1e6, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    ap.add_argument("--fp8", action="store_true", help="FP8 (E4M3) KV cache")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    if not plugins.available():
        sys.exit("needs a CUDA GPU and plugins/build/libpeagle_kernels.so (scripts/build_plugins.sh)")
    dtype = getattr(torch, args.dtype)
    results = []
    for b in (1, 8, 32):
        for s in (8, 14):  # verify (K=7) and drafter (P=8, K=7) rows
            for ctx in (512, 2048, 8192):
                r = attention_case(b, s, ctx, 32, 8, 128, dtype, args.fp8, args.iters)
                print(f"kv_attention b={b:3d} s={s:3d} ctx={ctx:5d}: {r['ms']:.4f} ms  {r['kv_gbps']:8.1f} GB/s")
                results.append(r)
    for rows, vocab in ((7, 32000), (56, 201088), (224, 151936)):
        r = sample_case(rows, vocab, args.iters)
        print(f"draft_sample rows={rows:3d} vocab={vocab}: {r['ms']:.4f} ms  {r['gbps']:8.1f} GB/s")
        results.append(r)
    print(json.dumps({"device": torch.cuda.get_device_name(), "results": results}))


if __name__ == "__main__":
    main()
