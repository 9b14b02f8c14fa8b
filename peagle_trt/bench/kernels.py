"""Suite `kernels` (docs/BENCHMARKS.md, "kernels"): the P-EAGLE Triton kernels (peagle_trt/ops/triton_kernels,
JIT through peagle_trt.ops.kernels) on a GPU, CUDA events, before and after in one run:

- KV attention of a Llama-3-8B-like layer (H=32, KV=8, d=128) at verify (K+1 = 8) and drafter
  (P+K-1 = 14) rows, batch 1/8/32/64, context 512-32768, its KV blocks scattered over the paged cache,
  each case twice: `unsplit` (num_splits=1, the kernel before flash-decoding) and `auto` (the split
  over the context that `split_plan` picks by shape; `splits` says how many segments);
- FP8 against bf16 linears at M = 1..64 rows (8B-class shapes: qkv, gate_up, down): bf16 `F.linear`,
  `FP8Linear`'s dequant path (the bf16 copy of the weight on every call: the path before this suite
  covered FP8 GEMMs), the Triton FP8 GEMM, `torch._scaled_mm` (sm_89+);
- the draft sampler (argmax + d2t). It does not matter at its sizes: 7 x 32k logits take one launch
  (~0.05 ms) and the largest case measured (224 x 152k fp32 logits, 136 MB) 0.17 ms at 17% of HBM on an
  H200, against >= 4 ms for one 8B-class forward's bandwidth floor (< 4%); one program per row is
  latency-bound there, a two-pass split over the vocabulary would be the fix if it ever shows.
Bytes read over the time: the bandwidth, and its share of the GPU's datasheet HBM peak. Needs CUDA
and triton (else a ConfigError naming what is missing).
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


def attention_case(b, s, ctx, h, kv, d, dtype, fp8, iters, block_size=BLOCK_SIZE, num_splits=None):
    from peagle_trt.ops.triton_kernels.kv_attention import split_plan

    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    q = torch.randn(b, s, h * d, device="cuda", dtype=dtype)
    k = torch.randn(b, s, kv * d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    positions = (torch.arange(s, device="cuda") + ctx - s + 1).expand(b, s).contiguous()
    m = -(-(ctx + 1) // block_size)  # table entries covering positions 0 .. ctx
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(b * m, generator=gen).view(b, m).to("cuda")  # scattered blocks
    kc = torch.randn(b * m + 1, block_size, kv, d, device="cuda", dtype=dtype).to(cache_dtype)  # + the trash block
    vc = torch.randn(b * m + 1, block_size, kv, d, device="cuda", dtype=dtype).to(cache_dtype)
    extra = dict(k_scale=0.05, v_scale=0.05) if fp8 else {}
    ms = median_ms(lambda: plugins.kv_attention(q, k, v, positions, tables, kc, vc, h, kv, d, num_splits=num_splits,
                                                **extra), iters, 3)
    kv_bytes = 2 * b * kv * (ctx + 1) * d * kc.element_size()
    tiles = -(-s * (h // kv) // 16)
    splits = num_splits or split_plan(b, kv, tiles, m * block_size,
                                      torch.cuda.get_device_properties(0).multi_processor_count)[0]
    return dict(op="kv_attention", mode="unsplit" if num_splits == 1 else "auto", splits=splits, batch=b, rows=s,
                context=ctx, heads=h, kv_heads=kv, head_dim=d, dtype=str(dtype), fp8_cache=fp8, ms=round(ms, 4),
                kv_gbps=round(kv_bytes / ms / 1e6, 1), roofline=roofline(kv_bytes / ms / 1e6))


LINEARS = {"qkv": (6144, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # name: (N, K), Llama-3-8B


def linear_cases(name, m, dtype, iters):
    """One 8B-class linear at M rows: bf16 F.linear, then FP8Linear's paths on the same weight."""
    import torch.nn.functional as F

    from peagle_trt.models.fp8 import FP8_DTYPE, FP8_MAX, FP8Linear, quantize_input
    from peagle_trt.ops.triton_kernels import fp8_linear

    n, k = LINEARS[name]
    w = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    layer = FP8Linear(k, n).to("cuda")
    layer.weight_scale.data = (w.abs().max().float() / FP8_MAX).reshape(())
    layer.weight.data = (w.float() / layer.weight_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    layer.input_scale.data = torch.tensor(4.0 / FP8_MAX, device="cuda")
    xs, ws = layer.input_scale.float().reshape(()), layer.weight_scale.float().reshape(())
    paths = {"bf16": (lambda: F.linear(x, w), w.numel() * w.element_size()),
             "fp8-dequant": (lambda: layer.forward(x), n * k),  # outside routed(): the dequant path
             "fp8-triton": (lambda: fp8_linear.fp8_linear(x, layer.weight, layer.weight_scale, layer.input_scale),
                            n * k)}
    if torch.cuda.get_device_capability() >= (8, 9):
        paths["fp8-scaled_mm"] = (lambda: torch._scaled_mm(quantize_input(x, layer.input_scale), layer.weight.t(),
                                                           scale_a=xs, scale_b=ws, out_dtype=dtype), n * k)
    out = []
    base = None
    for path, (fn, weight_bytes) in paths.items():
        ms = median_ms(fn, iters, 3)
        base = base or ms
        gbps = weight_bytes / ms / 1e6
        out.append(dict(op="linear", shape=name, n=n, k=k, m=m, path=path, ms=round(ms, 4),
                        vs_bf16=round(ms / base, 3), weight_gbps=round(gbps, 1), roofline=roofline(gbps)))
    return out


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
    batches, contexts, samples = (1, 8, 32, 64), (512, 2048, 8192, 32768), ((7, 32000), (56, 201088), (224, 151936))
    ms_rows, shapes = (1, 2, 4, 8, 16, 32, 64), tuple(LINEARS)
    if args.smoke:  # batch 1, context 8192 (split and unsplit), one linear at M 1 and 64, 5 iterations
        batches, contexts, samples, args.iters = (1,), (8192,), ((7, 32000),), 5
        ms_rows, shapes = (1, 64), ("qkv",)
    results = []
    for b in batches:
        for s in (8, 14):  # verify (K=7) and drafter (P=8, K=7) rows
            for ctx in contexts:
                for num_splits in (1, None):  # the unsplit kernel, then the plan's split
                    r = attention_case(b, s, ctx, 32, 8, 128, dtype, args.fp8, args.iters, num_splits=num_splits)
                    progress(f"kv_attention {r['mode']:7s} x{r['splits']:2d} b={b:3d} s={s:3d} ctx={ctx:5d}: "
                             f"{r['ms']:.4f} ms  {r['kv_gbps']:8.1f} GB/s")
                    results.append(r)
    for name in shapes:
        for m in ms_rows:
            for r in linear_cases(name, m, dtype, args.iters):
                progress(f"linear {name:7s} M={m:3d} {r['path']:13s}: {r['ms']:.4f} ms ({r['vs_bf16']:.2f}x bf16) "
                         f"{r['weight_gbps']:8.1f} GB/s")
                results.append(r)
    for rows, vocab in samples:
        r = sample_case(rows, vocab, args.iters)
        progress(f"draft_sample rows={rows:3d} vocab={vocab}: {r['ms']:.4f} ms  {r['gbps']:8.1f} GB/s")
        results.append(r)
    device = torch.cuda.get_device_name()
    attn = [r for r in results if r["op"] == "kv_attention"]
    big = max((r for r in attn if r["mode"] == "auto"), key=lambda r: (r["context"] == 8192, -r["batch"], -r["rows"]))
    figures = [Figure(f"kv_attention kernel (split by shape), batch {big['batch']} x {big['rows']} rows, context "
                      f"{big['context']}: share of the HBM peak", big["roofline"], "", ">= 0.7", 3)
               ] if big["roofline"] is not None else []
    one = [r for r in results if r["op"] == "linear" and r["m"] == 1 and r["path"] in ("fp8-triton", "fp8-dequant")]
    figures += [Figure(f"{r['shape']} linear at M = 1, {r['path']} / bf16", r["vs_bf16"], "x",
                       "<= 0.65" if r["path"] == "fp8-triton" else "", 3) for r in one[:2]]
    return finish(args, f"Triton kernels on {device} ({args.dtype}{', FP8 KV cache' if args.fp8 else ''}), median "
                  f"of {args.iters} iterations", [
                      records(attn, ["op", "mode", "splits", "batch", "rows", "context", "ms", "kv_gbps", "roofline"],
                              4),
                      records([r for r in results if r["op"] == "linear"],
                              ["shape", "m", "path", "ms", "vs_bf16", "weight_gbps", "roofline"], 4),
                      records([r for r in results if r["op"] == "draft_sample"],
                              ["op", "rows", "vocab", "ms", "gbps", "roofline"], 4)],
                  {"device": device, "results": results}, figures)
