"""Suite `fp8-quality` (docs/BENCHMARKS.md, "fp8-quality"): a ModelOpt FP8 target (default: the cached
SmolLM2 quantized now) against its float32 source on held-out stdlib text, teacher-forced windows
through our TargetModel: top-1 agreement and KL(p||q) per position, overall and where fp32 is confident.
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import torch

from peagle_trt.bench.harness import Figure, finish, model_dir, options, records
from peagle_trt.errors import ConfigError

MODULES = ("difflib", "argparse", "textwrap", "json.decoder")


def held_out_ids(target, windows: int, length: int) -> list[list[int]]:
    import importlib

    from peagle_trt.tokenizer import TextCodec

    text = "".join(inspect.getsource(importlib.import_module(m)) for m in MODULES)
    ids = TextCodec(target).tok(text)["input_ids"]
    if len(ids) < windows * length:
        raise ConfigError(f"only {len(ids)} tokens of held-out text; lower --windows or --window-len")
    return [ids[i * length:(i + 1) * length] for i in range(windows)]


def load(path):
    from peagle_trt.checkpoint.target import load_target
    from peagle_trt.models.target import TargetModel

    ckpt = load_target(path)
    return TargetModel.from_tensors(ckpt.config, ckpt.tensors, ()).eval()


@torch.no_grad()
def logits_of(model, ids: list[int]) -> torch.Tensor:
    tokens = torch.tensor([ids])  # [1, T]
    logits, _ = model(tokens, torch.arange(len(ids))[None], torch.tensor([0]), model.new_cache(1, len(ids) + 1))
    return logits[0].float()  # [T, V]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fp32", default="smollm2", help="the float32 target directory, or smollm2 (the cached "
                        "SmolLM2-135M-Instruct) (default: %(default)s)")
    parser.add_argument("--fp8", help="its `peagle-trt quantize` output (default: quantized now, built-in "
                        "calibration, into a temporary directory)")
    parser.add_argument("--windows", type=int, default=4, help="held-out windows (--smoke: 1)")
    parser.add_argument("--window-len", type=int, default=512, help="tokens per window (--smoke: 64)")
    options(parser, threads=2)


def run(args: argparse.Namespace) -> dict:
    import tempfile

    args.fp32 = str(model_dir(args.fp32))
    tmp = tempfile.TemporaryDirectory(prefix="peagle-fp8-quality-")
    if args.fp8 is None:
        from peagle_trt.quantize import QuantizeOptions, quantize_target

        args.fp8 = str(Path(tmp.name) / "fp8")
        quantize_target(args.fp32, args.fp8, QuantizeOptions(num_calib=4) if args.smoke else QuantizeOptions())
    torch.set_num_threads(args.threads)
    windows, length = (1, 64) if args.smoke else (args.windows, args.window_len)
    ref, fp8 = load(args.fp32), load(args.fp8)
    same, kl, confident = [], [], []  # per position: top-1 agrees, KL(p || q) in nats, fp32's top-1 p > 0.5
    for ids in held_out_ids(args.fp32, windows, length):
        p_log = torch.log_softmax(logits_of(ref, ids), -1)  # [T, V]
        q_log = torch.log_softmax(logits_of(fp8, ids), -1)  # [T, V]
        same.append((p_log.argmax(-1) == q_log.argmax(-1)).float())
        kl.append((p_log.exp() * (p_log - q_log)).sum(-1))
        confident.append(p_log.max(-1).values.exp() > 0.5)
    same, kl, confident = torch.cat(same), torch.cat(kl), torch.cat(confident)
    tmp.cleanup()
    results = {"positions": len(same), "top1_agreement": round(float(same.mean()), 4),
               "mean_kl_nats": round(float(kl.mean()), 5), "p95_kl_nats": round(float(kl.quantile(0.95)), 5),
               "confident_positions": int(confident.sum()),
               "confident_top1_agreement": round(float(same[confident].mean()), 4),
               "confident_mean_kl_nats": round(float(kl[confident].mean()), 5)}
    return finish(args, "FP8 (ModelOpt) against float32 on held-out text", [records([results], list(results), 5)],
                  {**results, "text": "+".join(MODULES), "windows": windows, "window_len": length},
                  [Figure("FP8 vs float32 top-1 agreement (SmolLM2-135M, held-out text)",
                          100 * results["top1_agreement"], "%", "", 1),
                   Figure("FP8 vs float32 mean KL (SmolLM2-135M)", results["mean_kl_nats"], "nats", "", 4)])
