"""Suite `decode` (docs/BENCHMARKS.md, "decode"): a real target (default the cached SmolLM2-135M) on this
CPU next to transformers and the roofline, one process, the same float32 weights and threads,
contenders alternated: batch-1 decode tokens/s, one verify forward of 1/2/4/8 rows after a 64-token
context, 8 concurrent requests over 1; the bandwidth and GEMM peak of the harness's machine measure.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from peagle_trt.bench.forwards import forward
from peagle_trt.bench.harness import Figure, alternate, finish, machine, options, progress, records

PROMPT = "Write a Python function that checks whether a number is prime."
ROWS, CONTEXT = (1, 2, 4, 8), 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    options(p, target="smollm2", threads=2, rounds=3)
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per decode run")
    p.add_argument("--max-seq-len", type=int, default=1024, help="KV positions per slot of our engines")


def model_costs(target) -> dict:
    """Bytes of weights one step reads (the embedding table once: tied or lm_head, plus the few
    embedding rows), and the GEMM parameters per row (FLOPs = 2 x params x rows)."""
    params = dict(target.named_parameters(remove_duplicate=False))
    lm, embed = params["lm_head.weight"], params["embed_tokens.weight"]
    read = sum({p.data_ptr(): p.numel() * p.element_size() for p in params.values()}.values())
    if lm.data_ptr() != embed.data_ptr():  # untied: the embedding table is not read, only rows
        read -= embed.numel() * embed.element_size()
    c = target.config
    return {"weight_bytes": read, "gemm_params": sum(p.numel() for n, p in params.items()
                                                     if p.dim() == 2 and n != "embed_tokens.weight"),
            "kv_bytes_per_pos": 2 * c.num_layers * c.num_kv_heads * c.head_dim * lm.element_size()}


def engine_decode(engine, n: int, batch: int = 1):
    """Our engine: `batch` requests of `n` tokens at once, stepped to the end
    (peagle_trt/bench/measure.py's run_batch)."""
    from peagle_trt.bench.measure import run_batch
    from peagle_trt.config import SamplingParams

    return lambda: run_batch(engine, [PROMPT] * batch, SamplingParams(max_tokens=n, ignore_eos=True), batch)


def hf_calls(model, ids: list[int], long_ids: list[int], n: int) -> tuple:
    """transformers: (its batch-1 `generate` of n tokens after `ids`, verify(m): a forward of m rows of
    `long_ids` after its first CONTEXT)."""
    from transformers import DynamicCache

    def generate():
        with torch.inference_mode():
            model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=n, min_new_tokens=n, do_sample=False)

    def verify(m: int):
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(torch.tensor([long_ids[:CONTEXT]]), past_key_values=cache, use_cache=True)

        def run():
            with torch.inference_mode():
                model(torch.tensor([long_ids[CONTEXT:CONTEXT + m]]), past_key_values=cache, use_cache=True)
            cache.crop(-m)  # back to the context
        return run
    return generate, verify


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from peagle_trt.config import SpecConfig
    from peagle_trt.serve.generator import TextGenerator
    from peagle_trt.tokenizer import TextCodec

    args.target = str(args.target)
    torch.set_num_threads(args.threads)
    rounds, n = (1, 8) if args.smoke else (args.rounds, args.tokens)
    mach = machine(args.smoke)
    bw, peak = mach["bandwidth_gbs"] * 1e9, mach["gemm_gflops"] * 1e9
    hf_logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    ids = TextCodec(args.target).encode_prompt(PROMPT, True)
    generate, hf_verify = hf_calls(hf, ids, (ids * (CONTEXT // len(ids) + 2))[:CONTEXT + max(ROWS)], n)
    engines = {b: TextGenerator.from_checkpoints(args.target, None, SpecConfig("none", 0), max_seq_len=args.max_seq_len,
                                                 max_batch=8, backend=b, threads=args.threads)
               for b in ("torch", "onnxruntime")}
    executors = {f"ours ({b})": e.scheduler.decoder.ex for b, e in engines.items()}  # verify on slot 0, idle
    costs = model_costs(executors["ours (torch)"].target_model)
    progress("[decode] decode, batch 1")
    decode = alternate({"transformers": generate, **{f"ours ({b})": engine_decode(e, n) for b, e in engines.items()}},
                       rounds)
    step_bytes = costs["weight_bytes"] + costs["kv_bytes_per_pos"] * (len(ids) + n // 2)
    tps = {name: n / statistics.median(t) for name, t in decode.items()}
    decode_rows = [{"decode, batch 1": name, "tokens_per_s": round(v, 2),
                    "x_transformers": round(v / tps["transformers"], 2),
                    "roofline_pct": round(100 * v * step_bytes / bw)} for name, v in tps.items()]
    progress("[decode] verify rows")
    verify = []  # per row count: the roofline and each contender's ms and share of it
    for m in ROWS:
        t = alternate({**{name: forward(ex, 1, m, CONTEXT) for name, ex in executors.items()},
                       "transformers": hf_verify(m)}, rounds)
        roof = max((costs["weight_bytes"] + costs["kv_bytes_per_pos"] * (CONTEXT + m)) / bw,
                   2 * costs["gemm_params"] * m / peak)
        verify.append({"rows": m, "roofline_ms": round(1e3 * roof, 1), **{
            f"{name} ms (% roofline)": f"{1e3 * statistics.median(v):.1f} ({100 * roof / statistics.median(v):.0f}%)"
            for name, v in t.items()}})
    progress("[decode] batch 1 vs batch 8")
    batch = []
    for b, e in engines.items():
        t = alternate({1: engine_decode(e, n, 1), 8: engine_decode(e, n, 8)}, rounds)
        b1, b8 = n / statistics.median(t[1]), 8 * n / statistics.median(t[8])
        batch.append({"backend": b, "b1_tokens_per_s": round(b1, 2), "b8_tokens_per_s": round(b8, 2),
                      "ratio": round(b8 / b1, 2)})
    default = decode_rows[-1]  # ours (onnxruntime)
    return finish(args, "SmolLM2-135M decode on CPU: ours vs transformers vs the roofline", [
        f"{args.threads} threads; {rounds} rounds; {step_bytes / 1e6:.0f} MB read per decode step",
        records(decode_rows, list(decode_rows[0]), 2), records(verify, list(verify[0]), 1),
        records(batch, list(batch[0]), 2)],
        {"rounds": rounds, "tokens": n, "prompt_tokens": len(ids), "model": costs,
         "step_bytes": step_bytes, "decode": {r["decode, batch 1"]: r for r in decode_rows}, "verify": verify,
         "batch": batch},
        [Figure("SmolLM2-135M decode, batch 1: ours (onnxruntime) over transformers' generate",
                default["x_transformers"], "x", ">= 1.5x", 1),
         Figure("SmolLM2-135M decode, batch 1: ours (onnxruntime), share of the bandwidth roofline",
                default["roofline_pct"], "%", ">= 60%", 0)], mach)
