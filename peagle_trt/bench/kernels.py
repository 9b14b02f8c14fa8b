"""Suite `kernels` (docs/BENCHMARKS.md, "kernels"): the P-EAGLE Triton kernels (peagle_trt/ops/triton_kernels,
JIT through peagle_trt.ops.kernels) on a GPU, before and after in one run:

- KV attention of a Llama-3-8B-like layer (H=32, KV=8, d=128) at verify (K+1 = 8) and drafter
  (P+K-1 = 14) rows, batch 1/8/32/64, context 512-32768, bf16 and FP8 caches, its KV blocks scattered
  over the paged cache, each case as `unsplit` (num_splits=1: one program per tile walks the whole
  context) and `auto` (the tiling `tiles_for` and the split `split_plan` pick by shape); at the
  headline case (batch 1 x 8 rows, context 8192) also a `sweep` of tilings (keys per step, pipeline
  stages) and split counts, the figures that set `tiles_for` and `split_plan`'s constants;
- FP8 against bf16 linears at M = 1..64 rows (8B-class shapes: qkv, gate_up, down): bf16 `F.linear`,
  `FP8Linear`'s dequant path (the bf16 copy of the weight on every call), the Triton FP8 GEMM,
  `torch._scaled_mm` (sm_89+); at M = 1 and 64 of the first shape also the GEMM's other candidate
  tilings (`fp8_linear.CANDIDATES`: `fp8-triton:c<i>`), the figures that set its defaults;
- the fused MoE op (PEagleMoE, triton_kernels/moe.py) at decode / verify / prefill-chunk rows 1, 8, 64 on
  the expert layers of the seeds' targets: Qwen3-30B-A3B (H 2048, 128 experts, top 8, I 768, FP8 128 x 128
  blocks) and GPT-OSS-20B (H 2880, 32 experts, top 4, I 2880, bf16 with biases), random router logits (near
  uniform routing: the most experts per row count, the pessimistic case); bandwidth = the weight bytes of the
  experts the rows hit / time, and its share of HBM; at Qwen3's decode row a `sweep` of tilings (`MoETiles`),
  the figures that set `moe.regime_tiles`;
- the draft sampler (argmax + d2t). It does not matter at its sizes: 7 x 32k logits take one launch
  (~0.05 ms) and the largest case measured (224 x 152k fp32 logits, 136 MB) 0.17 ms at 17% of HBM on an
  H200, against >= 4 ms for one 8B-class forward's bandwidth floor (< 4%).
How a case is timed (`graph_ms`): its calls captured back to back in one CUDA graph and replayed, so the
figure is the GPU's time, not the host's launch latency (a single launch timed between two events
costs 10-40 us of Python and driver work, more than a 33 MB attention read at HBM speed); each call
reads its own copy of the inputs (`copies`: as many as keep 3x the L2 between two reads of one copy),
so the bytes come from HBM, not from the L2 the previous call filled. Bytes read over the time: the
bandwidth, and its share of the GPU's datasheet HBM peak. Needs CUDA and triton (else a ConfigError
naming what is missing); `--rehearse` runs it without one, under Triton's interpreter (every case
at toy sizes on the CPU, timed eagerly, no roofline; tests/bench/test_kernels_bench.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

import torch

from peagle_trt.bench.harness import HBM_PEAK, Figure, finish, progress, records, timed
from peagle_trt.config import BLOCK_SIZE
from peagle_trt.errors import ConfigError
from peagle_trt.ops import kernels as plugins
from peagle_trt.ops.triton_kernels.common import interpreted

CALLS = 24  # calls per captured graph (its one launch is then a small share of the figure)
# the layer timed: Llama-3-8B's attention (heads, KV heads, head size) and linears (N, K); toy sizes for
# the CPU rehearsal
LAYER = dict(heads=32, kv_heads=8, head_dim=128, linears={"qkv": (6144, 4096), "gate_up": (28672, 4096),
                                                          "down": (4096, 14336)})
TOY = dict(heads=8, kv_heads=2, head_dim=16, linears={"qkv": (48, 32), "gate_up": (64, 32), "down": (32, 64)})


# the MoE layers timed: the seeds' targets' expert shapes; toy sizes for the CPU rehearsal
MOE = {"qwen3-30b-a3b": dict(hidden=2048, experts=128, top_k=8, inter=768, weights="fp8-block", routing="softmax_topk",
                             renormalize=True, activation="silu", bias=False),
       "gpt-oss-20b": dict(hidden=2880, experts=32, top_k=4, inter=2880, weights="bf16", routing="topk_softmax",
                           renormalize=False, activation="clamped_swiglu", bias=True)}
MOE_TOY = {"qwen3-30b-a3b": dict(MOE["qwen3-30b-a3b"], hidden=128, experts=4, top_k=2, inter=128),
           "gpt-oss-20b": dict(MOE["gpt-oss-20b"], hidden=64, experts=4, top_k=2, inter=64)}
MOE_ROWS = (1, 8, 64)


def on_gpu() -> bool:
    return torch.cuda.is_available()


def dev() -> str:
    return "cuda" if on_gpu() else "cpu"


def roofline(gbps: float) -> float | None:
    """Achieved / peak HBM bandwidth of this GPU (None when its peak is not in HBM_PEAK, or on CPU)."""
    if not on_gpu():
        return None
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in HBM_PEAK.items() if k in name), None)
    return None if peak is None else round(gbps * 1e9 / peak, 3)


def kv_kernel():
    from peagle_trt.ops.triton_kernels import kv_attention

    return kv_attention


def sample_kernel():
    from peagle_trt.ops.triton_kernels import draft_sample

    return draft_sample


def sms() -> int:
    from peagle_trt.ops.triton_kernels.kv_attention import DEFAULT_SMS

    return torch.cuda.get_device_properties(0).multi_processor_count if on_gpu() else DEFAULT_SMS


def copies(bytes_per_call: int, limit: int = 32) -> int:
    """Input copies to cycle through so that 3x the L2 is read between two reads of one copy."""
    if not on_gpu():
        return 2
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    return max(1, min(limit, -(-3 * l2 // max(bytes_per_call, 1))))


def graph_ms(calls: list[Callable[[], object]], rounds: int) -> float:
    """Milliseconds per call: `calls` (cycled to CALLS) captured back to back in one CUDA graph,
    replayed `rounds` times between CUDA events, the median over the replays / the calls. The calls
    run eagerly once first (Triton compiles, the allocator warms up). On CPU: each call once, timed."""
    if not on_gpu():
        return statistics.median([timed(fn) for fn in calls]) * 1e3
    seq = [calls[i % len(calls)] for i in range(max(CALLS, len(calls)))]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in seq:
            fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(seq))
    del graph
    return statistics.median(times)


def attention_case(b, s, ctx, h, kv, d, dtype, fp8, rounds, block_size=BLOCK_SIZE, num_splits=None, config=None,
                   mode=None):
    """One kv_attention launch shape: q/k/v of b x s rows at positions ctx - s + 1 .. ctx, each call over
    its own copy of the cache (scattered blocks). `num_splits` / `config`: forced (None: by shape)."""
    from peagle_trt.ops.triton_kernels.kv_attention import split_plan, tiles_for

    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    q = torch.randn(b, s, h * d, device=dev(), dtype=dtype)
    k = torch.randn(b, s, kv * d, device=dev(), dtype=dtype)
    v = torch.randn_like(k)
    positions = (torch.arange(s, device=dev()) + ctx - s + 1).expand(b, s).contiguous()
    m = -(-(ctx + 1) // block_size)  # table entries covering positions 0 .. ctx
    kv_bytes = 2 * b * kv * (ctx + 1) * d * torch.empty((), dtype=cache_dtype).element_size()
    n = copies(kv_bytes)
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(n * b * m, generator=gen).view(n, b, m).to(dev())  # scattered, disjoint per copy
    kc = torch.randn(n * b * m + 1, block_size, kv, d, device=dev(), dtype=dtype).to(cache_dtype)  # + trash
    vc = torch.randn_like(kc, dtype=dtype).to(cache_dtype)
    extra = dict(k_scale=0.05, v_scale=0.05) if fp8 else {}
    calls = [lambda t=t: kv_kernel().kv_attention(q, k, v, positions, t, kc, vc, h, kv, d, num_splits=num_splits,
                                              config=config, **extra) for t in tables]
    ms = graph_ms(calls, rounds)
    t = config or tiles_for(s * (h // kv), d, dtype, False)
    tiles = -(-s * (h // kv) // t.block_m)
    splits = num_splits or split_plan(b, kv, tiles, m * block_size, sms())
    mode = mode or ("unsplit" if num_splits == 1 else "auto")
    return dict(op="kv_attention", mode=mode, splits=splits, tiles=f"m{t.block_m} n{t.block_n} s{t.num_stages} "
                f"w{t.num_warps}", batch=b, rows=s, context=ctx, heads=h, kv_heads=kv, head_dim=d, dtype=str(dtype),
                fp8_cache=fp8, copies=n, ms=round(ms, 4), kv_gbps=round(kv_bytes / ms / 1e6, 1),
                roofline=roofline(kv_bytes / ms / 1e6))


def attention_sweep(b, s, ctx, dtype, rounds, layer=LAYER) -> list[dict]:
    """The headline shape under other tilings (keys per step x stages) and split counts (the plan's
    half and double): what `tiles_for` and `split_plan` should pick, measured. A tiling this GPU
    cannot launch (shared memory) is a row with its error."""
    from peagle_trt.ops.triton_kernels.kv_attention import Tiles, split_plan, tiles_for

    h, kv, d = layer["heads"], layer["kv_heads"], layer["head_dim"]
    base = tiles_for(s * (h // kv), d, dtype, False)
    plan = split_plan(b, kv, -(-s * (h // kv) // base.block_m), ctx + 1, sms())
    cases = [(Tiles(base.block_m, n, base.num_warps, st), plan) for n in (32, 64, 128) for st in (2, 3, 4)]
    cases += [(base, x) for x in sorted({max(plan // 2, 1), plan * 2}) if x != plan]
    cases += [(Tiles(base.block_m, base.block_n, 8, base.num_stages), plan)]
    rows = []
    for config, splits in cases:
        try:
            rows.append(attention_case(b, s, ctx, h, kv, d, dtype, False, rounds, num_splits=splits, config=config,
                                       mode="sweep"))
        except Exception as e:  # noqa: BLE001 -- a tiling over this GPU's limits is a finding, not a failure
            rows.append(dict(op="kv_attention", mode="sweep", splits=splits, tiles=f"m{config.block_m} "
                             f"n{config.block_n} s{config.num_stages} w{config.num_warps}", batch=b, rows=s,
                             context=ctx, fp8_cache=False, ms=None, kv_gbps=None, roofline=None,
                             error=f"{type(e).__name__}: {str(e)[:120]}"))
    return rows


def linear_cases(name, m, dtype, rounds, layer=LAYER, sweep=False):
    """One 8B-class linear at M rows: bf16 F.linear, then FP8Linear's paths on the same weights (each
    call on its own copy of the weight: `copies`); `sweep`: also the Triton GEMM under each other
    candidate tiling of its regime (`fp8_linear.CANDIDATES`, path "fp8-triton:c<i>")."""
    import torch.nn.functional as F

    from peagle_trt.models.fp8 import FP8_DTYPE, FP8_MAX, FP8Linear, quantize_input
    from peagle_trt.ops.triton_kernels import fp8_linear

    n, k = layer["linears"][name]
    x = torch.randn(m, k, device=dev(), dtype=dtype)
    ws, layers = [], []
    for _ in range(copies(n * k * 2)):
        w = torch.randn(n, k, device=dev(), dtype=dtype) * 0.02
        layer = FP8Linear(k, n).to(dev())
        layer.weight_scale.data = (w.abs().max().float() / FP8_MAX).reshape(())
        layer.weight.data = (w.float() / layer.weight_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        layer.input_scale.data = torch.tensor(4.0 / FP8_MAX, device=dev())
        ws.append(w)
        layers.append(layer)
    paths = {"bf16": ([lambda w=w: F.linear(x, w) for w in ws], n * k * 2),
             "fp8-dequant": ([lambda la=la: la.forward(x) for la in layers], n * k),  # outside routed()
             "fp8-triton": ([lambda la=la: fp8_linear.fp8_linear(x, la.weight, la.weight_scale, la.input_scale)
                             for la in layers], n * k)}
    if on_gpu() and torch.cuda.get_device_capability() >= (8, 9):
        paths["fp8-scaled_mm"] = ([lambda la=la: torch._scaled_mm(
            quantize_input(x, la.input_scale), la.weight.t(), scale_a=la.input_scale.float().reshape(()),
            scale_b=la.weight_scale.float().reshape(()), out_dtype=dtype) for la in layers], n * k)
    if sweep:  # every candidate tiling of this M's regime (the first is the default: "fp8-triton" above)
        for i, cfg in enumerate(fp8_linear.CANDIDATES[fp8_linear.regime(m)][1:], 1):
            paths[f"fp8-triton:c{i}"] = ([lambda la=la, c=cfg: fp8_linear.fp8_linear(
                x, la.weight, la.weight_scale, la.input_scale, config=c) for la in layers], n * k)
    out = []
    base = None
    for path, (calls, weight_bytes) in paths.items():
        try:
            ms = graph_ms(calls, rounds)
        except Exception as e:  # noqa: BLE001 -- a candidate over this GPU's limits is a finding, not a failure
            out.append(dict(op="linear", shape=name, n=n, k=k, m=m, path=path, ms=None,
                            error=f"{type(e).__name__}: {str(e)[:120]}"))
            continue
        base = base or ms
        gbps = weight_bytes / ms / 1e6
        out.append(dict(op="linear", shape=name, n=n, k=k, m=m, path=path, copies=len(calls), ms=round(ms, 4),
                        vs_bf16=round(ms / base, 3), weight_gbps=round(gbps, 1), roofline=roofline(gbps)))
    return out


def moe_kernel():
    from peagle_trt.ops.triton_kernels import moe

    return moe


def moe_weights(spec: dict, dtype: torch.dtype) -> tuple[tuple, int]:
    """One copy of a MoE layer's expert weights (w13, w2, b13, b2, w13_scale, w2_scale) in the spec's kind,
    and the bytes one expert's parameters take (what a routed expert costs to read)."""
    e, h, i = spec["experts"], spec["hidden"], spec["inter"]
    b13 = torch.randn(e, 2 * i, device=dev(), dtype=dtype) if spec["bias"] else None
    b2 = torch.randn(e, h, device=dev(), dtype=dtype) if spec["bias"] else None
    if spec["weights"] == "fp8-block":
        fp8 = torch.float8_e4m3fn
        w13 = (torch.randn(e, 2 * i, h, device=dev(), dtype=dtype) * 64).clamp(-448, 448).to(fp8)
        w2 = (torch.randn(e, h, i, device=dev(), dtype=dtype) * 64).clamp(-448, 448).to(fp8)
        s13 = torch.rand(e, -(-2 * i // 128), -(-h // 128), device=dev()) * h ** -0.5 / 64
        s2 = torch.rand(e, -(-h // 128), -(-i // 128), device=dev()) * i ** -0.5 / 64
    else:
        w13, w2 = torch.randn(e, 2 * i, h, device=dev(), dtype=dtype) * 0.02, torch.randn(e, h, i, device=dev(),
                                                                                            dtype=dtype) * 0.02
        s13 = s2 = None
    tensors = (w13, w2, b13, b2, s13, s2)
    per_expert = sum(t[0].numel() * t.element_size() for t in tensors if t is not None)
    return tensors, per_expert


def moe_case(model: str, spec: dict, rows: int, dtype: torch.dtype, rounds: int, config=None, mode: str = "auto",
             layers: list | None = None) -> dict:
    """One MoE layer at `rows` rows: each call on its own copy of the weights (`copies`) with its own router
    logits; bandwidth = the parameter bytes of the experts the rows hit (read back once, outside the timing)
    / time. `layers`: copies made already (the sweep reuses them)."""
    mk = moe_kernel()
    e, k = spec["experts"], spec["top_k"]
    x = torch.randn(rows, spec["hidden"], device=dev(), dtype=dtype)
    if layers is None:
        first, per_expert = moe_weights(spec, dtype)
        n = copies(per_expert * min(e, rows * k)) if on_gpu() else 1  # the interpreter: one copy is slow enough
        layers = [(first, per_expert)] + [moe_weights(spec, dtype) for _ in range(n - 1)]
    gen = torch.Generator().manual_seed(rows)
    logits = [torch.randn(rows, e, generator=gen).to(dev()) for _ in layers]
    kw = dict(top_k=k, routing=spec["routing"], renormalize=spec["renormalize"], activation=spec["activation"],
              config=config)
    calls = [lambda lg=lg, w=w: mk.moe(x, lg, w[0], w[1], w[2], w[3], None, w[4], w[5], **kw)
             for lg, (w, _) in zip(logits, layers)]
    ms = graph_ms(calls, rounds)
    hit = [len(set(mk.route(lg, k, spec["routing"], spec["renormalize"])[1].flatten().tolist())) for lg in logits]
    weight_bytes = statistics.mean(hit) * layers[0][1]
    gbps = weight_bytes / ms / 1e6
    t = config or mk.choose_tiles(rows, k, e, dtype, "block" if spec["weights"] == "fp8-block" else "none")
    return dict(op="moe", model=model, weights=spec["weights"], rows=rows, mode=mode, copies=len(layers),
                tiles=f"m{t.block_m} n{t.block_n} k{t.block_k} w{t.num_warps} s{t.num_stages}",
                experts_hit=round(statistics.mean(hit), 1), ms=round(ms, 4), weight_gbps=round(gbps, 1),
                roofline=roofline(gbps))


def moe_sweep(model: str, spec: dict, rows: int, dtype: torch.dtype, rounds: int) -> list[dict]:
    """The decode case under other tilings (N tile x stages x warps, a 64-row block): what
    `moe.regime_tiles` should pick, measured. A tiling this GPU cannot launch is a row with its error."""
    mk = moe_kernel()
    kind = "block" if spec["weights"] == "fp8-block" else "none"
    base = mk.choose_tiles(rows, spec["top_k"], spec["experts"], dtype, kind)
    cases = [mk.MoETiles(base.block_m, n, base.block_k, w, st) for n in (32, 64, 128) for w, st in ((4, 3), (4, 5),
                                                                                                    (8, 4))]
    cases += [mk.MoETiles(64, 64, base.block_k, 8, 3)]
    if not on_gpu():  # the rehearsal: two tilings show the path runs
        cases = cases[:1] + cases[-1:]
    first, per_expert = moe_weights(spec, dtype)
    n = copies(per_expert * rows * spec["top_k"]) if on_gpu() else 1
    layers = [(first, per_expert)] + [moe_weights(spec, dtype) for _ in range(n - 1)]
    rows_out = []
    for config in cases:
        try:
            rows_out.append(moe_case(model, spec, rows, dtype, rounds, config, "sweep", layers))
        except Exception as e:  # noqa: BLE001 -- a tiling over this GPU's limits is a finding, not a failure
            rows_out.append(dict(op="moe", model=model, weights=spec["weights"], rows=rows, mode="sweep",
                                 tiles=f"m{config.block_m} n{config.block_n} k{config.block_k} w{config.num_warps} "
                                 f"s{config.num_stages}", ms=None, weight_gbps=None, roofline=None,
                                 error=f"{type(e).__name__}: {str(e)[:120]}"))
    return rows_out


def sample_case(rows, vocab, rounds):
    logits = [torch.randn(rows, vocab, device=dev()) for _ in range(copies(rows * vocab * 4))]
    d2t = torch.zeros(vocab, dtype=torch.int64, device=dev())
    ms = graph_ms([lambda x=x: sample_kernel().draft_sample(x, d2t) for x in logits], rounds)
    gbps = rows * vocab * 4 / ms / 1e6
    return dict(op="draft_sample", rows=rows, vocab=vocab, ms=round(ms, 4), gbps=round(gbps, 1),
                roofline=roofline(gbps))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=20, help="graph replays per case (median reported)")
    ap.add_argument("--rehearse", action="store_true", help="without a GPU: every case at toy sizes on the CPU "
                    "under Triton's interpreter (proves the suite runs before it meets a GPU; no figures)")


def interpret() -> None:
    """Run the kernels under Triton's interpreter from here on (a process that has not imported them yet)."""
    import sys

    if interpreted():
        return
    if any(m.startswith("peagle_trt.ops.triton_kernels.") and m != "peagle_trt.ops.triton_kernels.common"
           for m in sys.modules):
        raise ConfigError("--rehearse needs a fresh process: the Triton kernels were imported already, compiled "
                          "for a GPU (or set TRITON_INTERPRET=1 before they are)")
    os.environ["TRITON_INTERPRET"] = "1"


def run(args: argparse.Namespace) -> dict:
    gpu = on_gpu()
    if not gpu and not args.rehearse:
        raise ConfigError("no CUDA device: the kernel benchmark times the kernels on a GPU (torch.cuda.is_available() "
                          "is False); --rehearse runs every case on the CPU under Triton's interpreter at toy sizes")
    if not gpu:
        interpret()
    if gpu and not plugins.available():
        raise ConfigError("the Triton kernels are unavailable: pip install -c constraints.txt -e '.[dev]' "
                          "(triton==3.9.0)")
    dtype, layer = getattr(torch, args.dtype), LAYER if gpu else TOY
    h, kv, d = layer["heads"], layer["kv_heads"], layer["head_dim"]
    batches, contexts, samples = (1, 8, 32, 64), (512, 2048, 8192, 32768), ((7, 32000), (56, 201088), (224, 151936))
    ms_rows, shapes, row_counts, head = (1, 2, 4, 8, 16, 32, 64), tuple(layer["linears"]), (8, 14), 8192
    if args.smoke:  # the targets' cases: batch 1 and 32 x 8 rows at 8192, the 32K FP8 check, the sweep
        batches, contexts, samples, args.rounds = (1, 32), (8192, 32768), ((7, 32000),), 5
        ms_rows, shapes, row_counts = (1, 64), ("qkv", "down"), (8,)
    if not gpu:  # the rehearsal: every path (split, unsplit, sweep, FP8), toy sizes
        batches, contexts, samples, args.rounds, head = (1, 2), (600, 1100), ((7, 320),), 1, 600
    results = []
    for b in batches:
        for s in row_counts:  # verify (K=7) and drafter (P=8, K=7) rows
            for ctx in contexts:
                if args.smoke and b > 1 and ctx > contexts[0]:
                    continue
                for fp8 in (False, True):
                    for num_splits in (1, None):  # the unsplit kernel, then the plan's tiles and split
                        if fp8 and num_splits == 1:
                            continue
                        r = attention_case(b, s, ctx, h, kv, d, dtype, fp8, args.rounds, num_splits=num_splits)
                        progress(f"kv_attention {r['mode']:7s} x{r['splits']:2d} {r['tiles']} b={b:3d} s={s:3d} "
                                 f"ctx={ctx:5d} {'fp8' if fp8 else dtype}: {r['ms']:.4f} ms  {r['kv_gbps']:8.1f} GB/s")
                        results.append(r)
    for r in attention_sweep(1, 8, head, dtype, args.rounds, layer):
        progress(f"kv_attention sweep x{r['splits']:2d} {r['tiles']}: {r['ms']} ms {r.get('error', '')}")
        results.append(r)
    for name in shapes:
        for m in ms_rows:
            for r in linear_cases(name, m, dtype, args.rounds, layer, sweep=name == shapes[0] and m in (1, 64)):
                progress(f"linear {name:7s} M={m:3d} {r['path']:15s}: {r['ms']} ms ({r.get('vs_bf16')}x bf16) "
                         f"{r.get('weight_gbps')} GB/s {r.get('error', '')}")
                results.append(r)
    for model, spec in (MOE if gpu else MOE_TOY).items():
        for rows in MOE_ROWS:
            r = moe_case(model, spec, rows, dtype, args.rounds)
            progress(f"moe {model} {spec['weights']} rows={rows:3d} {r['tiles']}: {r['ms']:.4f} ms, "
                     f"{r['experts_hit']} experts hit, {r['weight_gbps']:8.1f} GB/s")
            results.append(r)
    first = next(iter(MOE))
    for r in moe_sweep(first, (MOE if gpu else MOE_TOY)[first], 1, dtype, args.rounds):
        progress(f"moe sweep {r['tiles']}: {r['ms']} ms {r.get('weight_gbps')} GB/s {r.get('error', '')}")
        results.append(r)
    for rows, vocab in samples:
        r = sample_case(rows, vocab, args.rounds)
        progress(f"draft_sample rows={rows:3d} vocab={vocab}: {r['ms']:.4f} ms  {r['gbps']:8.1f} GB/s")
        results.append(r)
    where = torch.cuda.get_device_name() if gpu else "the CPU (Triton interpreter: a rehearsal, toy sizes)"
    return finish(args, f"Triton kernels on {where} ({args.dtype}), CUDA graphs of {CALLS} calls, median of "
                  f"{args.rounds} replays", tables(results), {"device": where, "results": results},
                  figures(results, head))


def figures(results: list[dict], head: int = 8192) -> list[Figure]:
    """The issue's targets: attention's share of HBM at 8192 (batch 1 and 32 x 8 rows), the FP8 cache
    against bf16 at the longest context, FP8 linears against bf16 at M = 1 and 64."""
    out = []
    auto = {(r["batch"], r["rows"], r["context"], r["fp8_cache"]): r for r in results
            if r["op"] == "kv_attention" and r["mode"] == "auto"}
    for b in (1, 32):
        r = auto.get((b, 8, head, False))
        if r and r["roofline"] is not None:
            out.append(Figure(f"kv_attention (by shape), batch {b} x 8 rows, context {head}: share of the HBM peak",
                              r["roofline"], "", ">= 0.7", 3))
    longest = max((c for (b, s, c, f) in auto if b == 1 and s == 8), default=None)
    if longest and (1, 8, longest, True) in auto:
        ratio = auto[(1, 8, longest, True)]["ms"] / auto[(1, 8, longest, False)]["ms"]
        out.append(Figure(f"kv_attention FP8 cache / bf16 cache time, batch 1 x 8 rows, context {longest}", ratio,
                          "x", "< 1", 3))
    for r in results:
        if r["op"] == "moe" and r["mode"] == "auto" and r["rows"] == 1 and r["roofline"] is not None:
            out.append(Figure(f"moe {r['model']} ({r['weights']}) at 1 row: routed experts' weights, share of the HBM "
                              "peak", r["roofline"], "", ">= 0.6", 3))
    for r in results:
        if r["op"] == "linear" and r["path"] == "fp8-triton" and r["m"] in (1, 64) and r.get("vs_bf16"):
            out.append(Figure(f"{r['shape']} linear at M = {r['m']}, fp8-triton / bf16", r["vs_bf16"], "x",
                              "<= 0.65" if r["m"] == 1 else "<= 1.0", 3))
    return out


def tables(results: list[dict]) -> list:
    attn = [r for r in results if r["op"] == "kv_attention"]
    return [records(attn, ["mode", "splits", "tiles", "batch", "rows", "context", "fp8_cache", "ms", "kv_gbps",
                           "roofline"], 4),
            records([r for r in results if r["op"] == "linear"],
                    ["shape", "m", "path", "ms", "vs_bf16", "weight_gbps", "roofline"], 4),
            records([r for r in results if r["op"] == "moe"], ["model", "weights", "rows", "mode", "tiles",
                                                               "experts_hit", "ms", "weight_gbps", "roofline"], 4),
            records([r for r in results if r["op"] == "draft_sample"], ["op", "rows", "vocab", "ms", "gbps",
                                                                        "roofline"], 4)]
