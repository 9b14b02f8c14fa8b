"""FP8 quality of a quantized target against its float32 source: top-1 agreement and mean KL over
held-out text (the numbers behind docs/BENCHMARKS.md "SmolLM2-135M: FP8 quality").

    peagle-trt convert --gguf smollm2 --output smol
    peagle-trt quantize --target smol --output smol-fp8          # ModelOpt FP8, built-in calibration
    python scripts/fp8_quality.py --fp32 smol --fp8 smol-fp8 [--windows 4 --window-len 512]

Held-out text: Python standard-library source (difflib, argparse, textwrap, json.decoder; not the
calibration prompts, which are chat requests), cut into `--windows` windows of `--window-len`
tokens, each run as one teacher-forced forward through our TargetModel (the FP8 one reproduces
ModelOpt's fake-quantized forward, peagle_trt/models/fp8.py). Per position: p = softmax(fp32
logits), q = softmax(fp8 logits); top-1 agreement = mean [argmax p == argmax q]; KL = sum p log(p/q)
in nats, averaged over positions. Also the same figures restricted to positions where the fp32 model
is confident (top-1 probability > 0.5). JSON on stdout.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import time

import torch

MODULES = ("difflib", "argparse", "textwrap", "json.decoder")


def held_out_ids(target, windows: int, length: int) -> list[list[int]]:
    import importlib

    from peagle_trt.tokenizer import TextCodec

    text = "".join(inspect.getsource(importlib.import_module(m)) for m in MODULES)
    ids = TextCodec(target).tok(text)["input_ids"]
    if len(ids) < windows * length:
        raise SystemExit(f"only {len(ids)} tokens of held-out text; lower --windows or --window-len")
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fp32", required=True, help="the float32 target directory")
    ap.add_argument("--fp8", required=True, help="its `peagle-trt quantize` output")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    ref, fp8 = load(args.fp32), load(args.fp8)
    agree, kl, confident_agree, confident_kl, n = [], [], [], [], 0
    for ids in held_out_ids(args.fp32, args.windows, args.window_len):
        p_log = torch.log_softmax(logits_of(ref, ids), -1)  # [T, V]
        q_log = torch.log_softmax(logits_of(fp8, ids), -1)  # [T, V]
        same = p_log.argmax(-1) == q_log.argmax(-1)  # [T]
        div = (p_log.exp() * (p_log - q_log)).sum(-1)  # [T] KL(p || q), nats
        confident = p_log.max(-1).values.exp() > 0.5  # [T]
        agree.append(same.float()), kl.append(div)
        confident_agree.append(same[confident].float()), confident_kl.append(div[confident])
        n += len(ids)
    cat = lambda xs: torch.cat(xs)  # noqa: E731
    print(json.dumps({
        "positions": n, "text": "+".join(MODULES), "windows": args.windows, "window_len": args.window_len,
        "top1_agreement": round(float(cat(agree).mean()), 4),
        "mean_kl_nats": round(float(cat(kl).mean()), 5),
        "p95_kl_nats": round(float(cat(kl).quantile(0.95)), 5),
        "confident_positions": int(cat(confident_agree).numel()),
        "confident_top1_agreement": round(float(cat(confident_agree).mean()), 4),
        "confident_mean_kl_nats": round(float(cat(confident_kl).mean()), 5),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "threads": args.threads,
        "torch": torch.__version__, "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
