"""Suite `moe` (docs/BENCHMARKS.md, "moe"): a mid-size Qwen3-MoE-shaped target on this CPU against its
dense twin, both backends, contenders alternated in one process.

    MoE target   4 layers, hidden 1024, 16 / 4 heads x 64, vocabulary 32000; every layer a sparse MoE of
                 64 experts of 512, top 8, softmax top-k renormalised (Qwen3-MoE's routing)
    dense twin   the same model with one dense MLP of 8 x 512 = 4096 per layer: the same expert bytes a
                 token reads, so the twin's decode is what the MoE's could be with free routing

Random float32 weights (peagle_trt/bench/seed_models.py `materialize`): a random router routes close
to uniformly, the pessimistic case for a verify (K + 1 rows touch the most experts). Measured:
decode tokens/s at batch 1 after a short prompt (from runs of N and of 1 tokens: (N - 1) / (t_N - t_1),
prefill excluded), target alone and with a random 1-layer P-EAGLE head at K = 3 whose drafts are
accepted by vLLM's synthetic rule at a stated acceptance length (the output is not the target's:
speed only), on the torch and onnxruntime executors; and one target forward of 1, 4 and 8 rows.
Headline: the MoE's decode over the twin's, per backend. `--smoke`: a small model, seconds.
How to run: `peagle-trt bench moe --output-dir artifacts/bench` (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from peagle_trt.bench.harness import Figure, alternate, finish, machine, progress, records

CONFIG = {"model_type": "qwen3_moe", "hidden_size": 1024, "intermediate_size": 4096, "moe_intermediate_size": 512,
          "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
          "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
          "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 4096,
          "vocab_size": 32000, "tie_word_embeddings": False, "hidden_act": "silu"}
SMALL = {"hidden_size": 64, "intermediate_size": 256, "moe_intermediate_size": 32, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "num_experts": 16, "vocab_size": 512}
SMOKE = dict(tokens=6, rounds=1)  # the options of --smoke (which also shrinks the model: SMALL)
K, AL = 3, 2.5  # the head's drafts per step and the synthetic acceptance length
PROMPT = list(range(100, 116))  # 16 tokens
ROWS = (1, 4, 8)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=24, help="tokens per decode run (default 24)")
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds (default 5)")
    p.add_argument("--threads", type=int, default=2, help="torch / onnxruntime threads (default 2)")
    p.add_argument("--backends", default="torch,onnxruntime", help="comma list of executors")


def configs(smoke: bool) -> dict[str, dict]:
    """{"moe": the MoE target's config.json, "dense": its twin's}."""
    moe = {**CONFIG, **(SMALL if smoke else {})}
    dense = {**moe, "mlp_only_layers": list(range(moe["num_hidden_layers"])),
             "intermediate_size": moe["moe_intermediate_size"] * moe["num_experts_per_tok"]}
    return {"moe": moe, "dense": dense}


def build(cfg: dict):
    """(target, P-EAGLE head) with random float32 weights on the CPU."""
    from peagle_trt.architecture import DrafterConfig
    from peagle_trt.bench.seed_models import materialize
    from peagle_trt.checkpoint.adapters import adapter_for
    from peagle_trt.models.drafter import DrafterModel
    from peagle_trt.models.rope import inv_freq
    from peagle_trt.models.target import TargetModel

    c = adapter_for(cfg, "bench moe").parse(cfg, "bench moe")
    with torch.device("meta"):
        target = TargetModel(c, c.default_taps)
    target = materialize(target, "cpu", torch.float32)
    target.set_inv_freqs()
    head = DrafterConfig(layout="aws", hidden_size=c.hidden_size, num_layers=1, num_heads=c.num_heads,
                         num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, intermediate_size=c.hidden_size * 2,
                         rms_norm_eps=c.rms_norm_eps, rope=c.rope, vocab_size=c.vocab_size,
                         draft_vocab_size=c.vocab_size // 4, target_hidden_size=c.hidden_size,
                         mask_token_id=c.vocab_size - 1, has_mask_hidden=True)
    with torch.device("meta"):
        drafter = DrafterModel(head)
    drafter = materialize(drafter, "cpu", torch.float32)
    with torch.no_grad():
        drafter.d2t = torch.zeros(head.draft_vocab_size, dtype=torch.long)
        drafter.inv_freq = inv_freq(head.rope, head.head_dim)[0]
        drafter.mask_hidden = torch.randn(1, 1, head.num_aux * head.target_hidden_size) * 0.02
        drafter.h_mask = drafter.project(drafter.mask_hidden).reshape(-1)
    return target, drafter


def executor(backend: str, target, drafter, spec, threads: int):
    from peagle_trt.executors.onnxruntime import OrtExecutor
    from peagle_trt.executors.torch import TorchExecutor

    max_len = len(PROMPT) + 512
    if backend == "torch":
        return TorchExecutor(target, drafter if spec.mode != "none" else None, 1, max_len)
    return OrtExecutor.from_models(target, drafter if spec.mode != "none" else None,
                                   spec if spec.mode != "none" else None, 1, max_len, threads=threads)


def run(args: argparse.Namespace) -> dict:
    from peagle_trt.bench.forwards import forward
    from peagle_trt.config import SamplingParams, SpecConfig
    from peagle_trt.runtime.scheduler import generate
    from peagle_trt.speculative.decoder import SpecDecoder
    from peagle_trt.speculative_config import synthetic_rates_for_length

    torch.set_num_threads(args.threads)
    rounds, n = args.rounds, args.tokens
    mach = machine(args.smoke)
    backends = [b for b in args.backends.split(",") if b]
    specs = {"none": SpecConfig("none", 0),
             "peagle": SpecConfig("peagle", K, synthetic_rates=synthetic_rates_for_length(AL, K))}
    models = {name: build(cfg) for name, cfg in configs(args.smoke).items()}
    decoders = {(m, b, s): SpecDecoder(executor(b, *models[m], spec, args.threads), spec)
                for m in models for b in backends for s, spec in specs.items()}

    def run_n(dec, tokens: int):
        return lambda: generate(dec, PROMPT, SamplingParams(max_tokens=tokens, ignore_eos=True), prefill_chunk=64)

    progress("[moe] decode, batch 1: MoE vs dense twin, target alone and P-EAGLE")
    calls = {}
    for key, dec in decoders.items():
        calls[(*key, n)], calls[(*key, 1)] = run_n(dec, n), run_n(dec, 1)
    times = alternate({"/".join(map(str, k)): fn for k, fn in calls.items()}, rounds)
    tps = {}
    for (m, b, s) in decoders:
        long, short = (statistics.median(times[f"{m}/{b}/{s}/{t}"]) for t in (n, 1))
        tps[(m, b, s)] = (n - 1) / max(long - short, 1e-9)
    decode = [{"backend": b, "speculation": s, "moe_tokens_per_s": round(tps[("moe", b, s)], 2),
               "dense_tokens_per_s": round(tps[("dense", b, s)], 2),
               "moe_over_dense": round(tps[("moe", b, s)] / tps[("dense", b, s)], 3),
               "peagle_over_none": round(tps[("moe", b, s)] / tps[("moe", b, "none")], 3)}
              for b in backends for s in specs]
    progress("[moe] one target forward of 1, 4, 8 rows")
    fwd = alternate({f"{m}/{b}/{r}": forward(decoders[(m, b, "none")].ex, 1, r, 64)
                     for m in models for b in backends for r in ROWS}, rounds)
    verify = [{"backend": b, "rows": r, **{f"{m} ms": round(1e3 * statistics.median(fwd[f"{m}/{b}/{r}"]), 2)
                                           for m in models}} for b in backends for r in ROWS]
    for row in verify:
        row["moe_over_dense_time"] = round(row["moe ms"] / row["dense ms"], 2)
    cfg = configs(args.smoke)["moe"]
    shape = (f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, {cfg['num_experts']} experts of "
             f"{cfg['moe_intermediate_size']} top {cfg['num_experts_per_tok']}; twin MLP "
             f"{cfg['moe_intermediate_size'] * cfg['num_experts_per_tok']}")
    figures = [Figure(f"mid-size MoE over its dense twin, decode batch 1 ({b})",
                      next(r["moe_over_dense"] for r in decode if r["backend"] == b and r["speculation"] == "none"),
                      "x", ">= 0.5" if b == "onnxruntime" else ">= 0.66", 2) for b in backends]
    return finish(args, "A mid-size MoE target on CPU against its dense twin", [
        f"{shape}; random float32 weights; {args.threads} threads; {rounds} rounds; {n} tokens; P-EAGLE K = {K} at "
        f"synthetic AL {AL} (speed only)", records(decode, list(decode[0]), 3), records(verify, list(verify[0]), 2)],
        {"config": cfg, "tokens": n, "rounds": rounds, "decode": decode, "verify": verify}, figures, mach)
