"""Suite `paged` (docs/BENCHMARKS.md, "paged"): what the paged KV cache buys on the real model, target only,
onnxruntime, greedy, outputs compared: `capacity` (a fixed KV budget serving a 3:1 mix of chat and
long-context requests: contiguous per-request slots vs paged blocks: peak running, tokens/s,
preemptions), `prefix` (TTFT of requests sharing a system prompt, with and without prefix reuse),
`block` (batch-1 decode, blocks of 32 vs one block of 1024 per request); contenders alternated.
"""

from __future__ import annotations

import argparse
import time
from statistics import median

from peagle_trt.bench.harness import Figure, alternate, finish, options, progress, records, reported

SMOKE = dict(max_seq_len=256, requests=6, short_tokens=4, long_prompt=100, system_tokens=70, questions=1,
             decode_tokens=4, rounds=1)  # and 3 contiguous slots' worth of blocks


def add_arguments(p: argparse.ArgumentParser) -> None:
    options(p, target="smollm2", threads=2, rounds=2)
    p.add_argument("--budget-mib", type=int, default=256, help="KV memory of the capacity phase (MiB)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="longest request (prompt + output)")
    p.add_argument("--max-batch", type=int, default=32, help="paged: most requests per step")
    p.add_argument("--requests", type=int, default=24, help="capacity: requests of the mix")
    p.add_argument("--short-tokens", type=int, default=96, help="capacity: max_tokens of a chat request")
    p.add_argument("--long-prompt", type=int, default=1200, help="capacity: tokens of a long-context prompt")
    p.add_argument("--system-tokens", type=int, default=1024, help="prefix: shared system prompt tokens")
    p.add_argument("--questions", type=int, default=6, help="prefix: requests timed per contender")
    p.add_argument("--decode-tokens", type=int, default=64, help="block: tokens per batch-1 run")


def serve(sched, work: list[tuple[list[int], int]]) -> dict:
    """All of `work` (prompt ids, max_tokens) queued at once, stepped to the end."""
    from peagle_trt.config import SamplingParams
    from peagle_trt.runtime.scheduler import Request

    outputs: dict[int, list[int]] = {i: [] for i in range(len(work))}
    for i, (prompt, n) in enumerate(work):
        sched.add(Request(str(i), prompt, SamplingParams(max_tokens=n, ignore_eos=True),
                          lambda out, i=i: outputs[i].extend(out.new_token_ids)))
    peak, t0 = 0, time.perf_counter()
    while sched.has_work:
        sched.step()
        peak = max(peak, len(sched.running))
    wall, tokens = time.perf_counter() - t0, sum(map(len, outputs.values()))
    return {"peak_running": peak, "wall_s": round(wall, 2), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
            "preemptions": sched.blocks.stats.preemptions, "outputs": list(outputs.values())}


def ttft(sched, prompt: list[int]) -> float:
    from peagle_trt.config import SamplingParams
    from peagle_trt.runtime.scheduler import Request

    first: list[float] = []
    t0 = time.perf_counter()
    sched.add(Request("q", prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                      lambda out: first.append(time.perf_counter()) if out.new_token_ids and not first else None))
    sched.run_until_idle()
    return first[0] - t0


def workloads(codec, args) -> tuple[list, list, list]:
    """(capacity mix, prefix questions with their system prompt, the block-size prompt) as token ids."""
    from peagle_trt.bench.prompts import stdlib_files
    from peagle_trt.train.instructions import instructions

    rows = [r for r in instructions("heldout", seed=0) if r["kind"] in ("write", "explain", "complete")]
    chats = [codec.encode_prompt(r["prompt"], True)[:args.max_seq_len // 4] for r in rows]
    sources = [p.read_text(errors="replace") for p in stdlib_files()[::40]]
    longs = [ids[:args.long_prompt] for ids in (codec.encode_prompt(s, False) for s in sources)
             if len(ids) >= args.long_prompt]
    mix = [(longs[(i // 4) % len(longs)] if i % 4 == 3 else chats[i % len(chats)], args.short_tokens)
           for i in range(args.requests)]
    system = codec.encode_prompt(sources[0] * 4, False)[:args.system_tokens]
    questions = [system + codec.encode_prompt(r["prompt"], False)[:48] for r in rows[:args.questions + 1]]
    return mix, questions, chats[0][:64]


def run(args: argparse.Namespace) -> dict:
    from peagle_trt.checkpoint import load_pair
    from peagle_trt.config import KVLayout, SpecConfig
    from peagle_trt.executors.onnxruntime import OrtExecutor
    from peagle_trt.models.memory import kv_memory
    from peagle_trt.runtime.scheduler import Scheduler
    from peagle_trt.speculative.decoder import SpecDecoder
    from peagle_trt.tokenizer import TextCodec

    target_dir = args.target
    target, _ = load_pair(target_dir, None, SpecConfig("none", 0)).build()
    mix, questions, decode_prompt = workloads(TextCodec(target_dir), args)

    def scheduler(kv, max_batch: int = 1, prefix_caching: bool = True):  # kv: a KVLayout or an executor
        ex = kv if hasattr(kv, "target") else OrtExecutor.from_models(target, None, None, kv, threads=args.threads)
        return Scheduler(SpecDecoder(ex, SpecConfig("none", 0)), max_batch=max_batch, prefill_chunk=256,
                         prefix_caching=prefix_caching)

    max_len = args.max_seq_len + 1
    slot_blocks = KVLayout.for_sequences(1, max_len).max_blocks
    per_block = kv_memory(target.config, None, KVLayout.for_sequences(1, max_len), 4).bytes_per_block
    blocks = 3 * slot_blocks + 2 if args.smoke else args.budget_mib * 2 ** 20 // per_block
    slots = blocks // slot_blocks
    progress(f"capacity: {blocks} blocks ({per_block / 1024:.0f} KiB each): {slots} contiguous slots of {max_len}")
    shared = OrtExecutor.from_models(target, None, None, KVLayout(blocks, max_len, args.max_batch, 32),
                                     threads=args.threads)  # one budget for both contenders
    capacity = {name: serve(scheduler(shared, batch), mix)
                for name, batch in (("contiguous", max(slots, 1)), ("paged", args.max_batch))}
    same = capacity["paged"].pop("outputs") == capacity["contiguous"].pop("outputs")

    progress(f"prefix: {len(questions) - 1} requests sharing {args.system_tokens} tokens")
    prefix = {"reuse": scheduler(KVLayout.for_sequences(2, max_len)),
              "recompute": scheduler(KVLayout.for_sequences(2, max_len), prefix_caching=False)}
    asked = {}
    for name, sched in prefix.items():
        ttft(sched, questions[0])  # warms the prefix cache (the same work for the other contender)
        asked[name] = iter(questions[1:])  # each contender asks the same questions in order, one per round
    ttfts = alternate({name: lambda name=name: ttft(prefix[name], next(asked[name])) for name in prefix},
                      len(questions) - 1, warmup=0, clock=reported)
    hit = prefix["reuse"].blocks.metrics()

    progress("block: batch-1 decode, blocks of 32 vs one block of 1024 per request")
    decoders = {"blocks of 32": scheduler(KVLayout.for_sequences(1, 1024)),
                "one block of 1024": scheduler(KVLayout.for_sequences(1, 1024, block_size=1024))}
    outs = {}

    def decode(name: str) -> None:
        outs[name] = serve(decoders[name], [(decode_prompt, args.decode_tokens)])["outputs"]

    times = alternate({name: lambda name=name: decode(name) for name in decoders}, args.rounds)
    same = same and outs["blocks of 32"] == outs["one block of 1024"]
    rows = [{"phase": "capacity", "contender": name, **v} for name, v in capacity.items()]
    rows += [{"phase": "prefix", "contender": name, "ttft_ms": round(median(v) * 1e3, 1)} for name, v in ttfts.items()]
    rows += [{"phase": "block", "contender": name, "tokens_per_s": round(args.decode_tokens / median(v), 2)}
             for name, v in times.items()]
    paged, contiguous = capacity["paged"], capacity["contiguous"]
    ratio = {"capacity_peak_ratio": round(paged["peak_running"] / contiguous["peak_running"], 2),
             "capacity_throughput_ratio": round(paged["tokens_per_s"] / contiguous["tokens_per_s"], 2),
             "prefix_ttft_speedup": round(median(ttfts["recompute"]) / median(ttfts["reuse"]), 2),
             "block_32_speedup": round(median(times["one block of 1024"]) / median(times["blocks of 32"]), 3)}
    figures = [Figure("SmolLM2-135M paged KV: requests at once over contiguous slots, same budget",
                      ratio["capacity_peak_ratio"], "x", "", 1),
               Figure("SmolLM2-135M prefix reuse: TTFT speed-up (shared system prompt)",
                      ratio["prefix_ttft_speedup"], "x", "", 1)]
    return finish(args, "Paged KV cache and prefix reuse", [
        records(rows, ["phase", "contender", "peak_running", "wall_s", "tokens_per_s", "preemptions", "ttft_ms"], 1),
        f"ratios: {ratio}; outputs identical across contenders: {same}"], {
            "blocks": blocks, "block_bytes": per_block, "contiguous_slots": slots,
            "prefix_hit_tokens": hit["prefix_hit_tokens"], "prefix_queried_tokens": hit["prefix_queried_tokens"],
            "outputs_identical": same, **ratio, "rows": rows}, figures)
