"""Suite `kv-fp8` (docs/BENCHMARKS.md, "kv-fp8"): a real target (default the cached SmolLM2-135M) on this
CPU with its KV cache in the model's float32 (`--kv-cache-dtype auto`) and in FP8 E4M3 (`fp8`; scales 1.0,
as vLLM's when a checkpoint has none), on both backends (torch reference ops, onnxruntime graphs), one
process, the contenders alternated: one decode forward (1 row) after 64 and --context cached positions,
and batch-1 greedy decode tokens/s; then the FP8 cache's greedy agreement with float32's on the first
--prompts HumanEval requests (identical tokens, identical leading tokens; teacher-forced along float32's
output: top-1 agreement and the largest |logit| difference).

    peagle-trt bench kv-fp8 [--target smollm2] [--context 1024] [--prompts 8] [--tokens 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from peagle_trt.bench.forwards import forward
from peagle_trt.bench.harness import Figure, alternate, finish, machine, options, progress, records

BACKENDS = ("torch", "onnxruntime")
CACHES = ("auto", "fp8")
SHORT = 64  # cached positions of the short decode forward


def add_arguments(p: argparse.ArgumentParser) -> None:
    options(p, target="smollm2", threads=2, rounds=5, context=1024)
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per request (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=8, help="HumanEval requests for the agreement (default: %(default)s)")


def executors(target, kv_len: int, threads: int) -> dict[tuple[str, str], object]:
    """(backend, cache dtype) -> a target-only executor over the one loaded model, room for one request."""
    from peagle_trt.config import KVLayout
    from peagle_trt.executors.onnxruntime import OrtExecutor
    from peagle_trt.executors.torch import TorchExecutor

    out = {}
    for cache in CACHES:
        kv = KVLayout.for_sequences(1, kv_len, cache_dtype=cache)
        out["torch", cache] = TorchExecutor(target, None, kv)
        out["onnxruntime", cache] = OrtExecutor.from_models(target, None, None, kv, threads=threads)
    return out


def greedy(ex, ids: list[int], n: int) -> list[int]:
    from peagle_trt.config import SamplingParams, SpecConfig
    from peagle_trt.runtime.scheduler import generate
    from peagle_trt.speculative.decoder import SpecDecoder

    return generate(SpecDecoder(ex, SpecConfig("none", 0)), ids, SamplingParams(max_tokens=n, ignore_eos=True)).output


@torch.inference_mode()
def teacher_forced(ex, ids: list[int], out: list[int]) -> torch.Tensor:
    """Logits [len(out), V] predicting each of `out` after `ids`, one prefill from position 0."""
    tokens = torch.tensor([ids + out[:-1]])
    tables = ex.kv_tables(torch.tensor([0]))
    logits, _ = ex.target(tokens, torch.arange(tokens.shape[1])[None], tables)
    return logits[0, len(ids) - 1:].float()


def agreement(exs: dict, prompts: list[list[int]], n: int) -> tuple[list[dict], dict]:
    """Per request: the FP8 cache's greedy output against float32's (onnxruntime, the CPU default),
    and torch's teacher-forced logits of both along float32's output."""
    rows, same, lead, top1, worst, total = [], 0, 0, 0, 0.0, 0
    for i, ids in enumerate(prompts):
        ref, got = greedy(exs["onnxruntime", "auto"], ids, n), greedy(exs["onnxruntime", "fp8"], ids, n)
        a, b = (teacher_forced(exs["torch", c], ids, ref) for c in CACHES)
        first = next((j for j, (x, y) in enumerate(zip(ref, got)) if x != y), n)
        agree = int((a.argmax(-1) == b.argmax(-1)).sum())
        err = float((a - b).abs().max())
        rows.append({"request": i, "prompt tokens": len(ids), "identical tokens": sum(x == y for x, y in zip(ref, got)),
                     "identical leading tokens": first, "teacher-forced top-1 agreement": f"{agree}/{n}",
                     "max |logit diff|": err})
        same, lead, top1, worst, total = same + rows[-1]["identical tokens"], lead + first, top1 + agree, \
            max(worst, err), total + n
    return rows, {"tokens": total, "identical_pct": 100 * same / total, "leading_pct": 100 * lead / total,
                  "top1_pct": 100 * top1 / total, "max_logit_diff": worst}


def run(args: argparse.Namespace) -> dict:
    from peagle_trt.bench.measure import HUMANEVAL_REQUEST
    from peagle_trt.bench.prompts import humaneval_prompts
    from peagle_trt.checkpoint import load_pair
    from peagle_trt.config import SpecConfig
    from peagle_trt.models.memory import kv_memory
    from peagle_trt.tokenizer import TextCodec

    torch.set_num_threads(args.threads)
    rounds, n, count, context = (1, 8, 2, 96) if args.smoke else (args.rounds, args.tokens, args.prompts, args.context)
    mach = machine(args.smoke)
    codec = TextCodec(args.target)
    prompts = [codec.encode_prompt(HUMANEVAL_REQUEST.format(prompt=p["prompt"])) for p in humaneval_prompts()[:count]]
    target, _ = load_pair(args.target, None, SpecConfig("none", 0)).build()
    kv_len = max(context + 2, max(len(p) for p in prompts) + n + 1)
    exs = executors(target, kv_len, args.threads)
    names = {key: f"{key[0]}, {'FP8' if key[1] == 'fp8' else 'float32'} cache" for key in exs}
    speed = []
    for ctx in (SHORT, context):
        progress(f"[kv-fp8] decode forward after {ctx} positions")
        t = alternate({names[key]: forward(ex, 1, 1, ctx) for key, ex in exs.items()}, rounds * 3)
        speed.append({"what": f"decode forward, {ctx} cached positions", **{
            names[key]: 1e3 * statistics.median(t[names[key]]) for key in exs}})
    progress("[kv-fp8] greedy decode, batch 1")
    ids = prompts[0]
    t = alternate({names[key]: (lambda ex=ex: greedy(ex, ids, n)) for key, ex in exs.items()}, rounds)
    speed.append({"what": f"greedy decode, {n} tokens (tok/s)", **{
        names[key]: n / statistics.median(t[names[key]]) for key in exs}})
    ratios = [{"what": row["what"], **{b: row[names[b, "fp8"]] / row[names[b, "auto"]] for b in BACKENDS}}
              for row in speed]
    progress("[kv-fp8] greedy agreement with the float32 cache")
    rows, agreed = agreement(exs, prompts, n)
    per_pos = {c: kv_memory(target.config, None, exs["torch", c].kv, 4).bytes_per_position for c in CACHES}
    long_ratio = ratios[1]["onnxruntime"]
    return finish(args, "FP8 (E4M3) KV cache on CPU: decode speed and greedy agreement with float32", [
        f"{args.threads} threads; {rounds} rounds (forwards: {3 * rounds}); KV bytes per position: "
        f"{per_pos['auto']:.0f} (float32) vs {per_pos['fp8']:.0f} (FP8); scales 1.0 (no calibrated k_scale / "
        "v_scale in this checkpoint)",
        "Medians: forwards in ms, decode in tokens/s.\n\n" + records(speed, list(speed[0]), 2),
        "FP8 cache over float32 cache (time ratio for forwards, speed ratio for decode):\n\n"
        + records(ratios, list(ratios[0]), 3),
        f"Greedy agreement over {agreed['tokens']} tokens: {agreed['identical_pct']:.1f}% identical, "
        f"{agreed['leading_pct']:.1f}% before the first difference; teacher-forced top-1 "
        f"{agreed['top1_pct']:.1f}%.\n\n" + records(rows, list(rows[0]), 4)],
        {"rounds": rounds, "tokens": n, "context": context, "speed": speed, "ratios": ratios, "agreement": agreed,
         "requests": rows, "kv_bytes_per_position": per_pos},
        [Figure(f"FP8 KV cache, onnxruntime decode forward at {context} positions: time over float32's",
                long_ratio, "x", "", 2),
         Figure("FP8 KV cache: greedy tokens identical to the float32 cache's", agreed["identical_pct"], "%", "", 1),
         Figure("FP8 KV cache: teacher-forced top-1 agreement with the float32 cache", agreed["top1_pct"], "%",
                "", 1)], mach)
