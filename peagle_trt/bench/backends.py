"""Suite `backends` (docs/BENCHMARKS.md, "backends"): on CPU, per shape (Llama target + AWS-layout P-EAGLE
drafter, random weights: `tiny`, hidden 64; `h512`, hidden 512, 8 layers, vocab 4096): the FP8 quantize
time (ModelOpt; its import timed alone), the ONNX export of the fp32 and FP8 targets, and decode, verify
(K+1 rows) and draft steps, torch vs onnxruntime executor, batch 1 and 4 at --context. The backends run
one block after the other unless --interleave (on 2 cores each one's spinning thread pool slows the
other). FP8 on CPU is emulated: not a GPU forecast.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from peagle_trt.bench.forwards import forward
from peagle_trt.bench.harness import Figure, alternate, finish, progress, records, stdout_to_stderr, summary, timed
from peagle_trt.config import SpecConfig
from peagle_trt.errors import ConfigError
from peagle_trt.make_tiny import checkpoints as tiny

K, SLOTS, MAX_SEQ_LEN, PENDING = 7, 4, 512, 4  # pending rows of a draft pass: 3 accepted drafts + the bonus
H512 = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
            head_dim=64, initializer_range=0.02)


def steps(ex, b: int, context: int) -> dict:
    """decode, verify and draft calls of executor `ex` at batch `b` (request i in its own blocks)."""
    m = ex.kv.max_blocks
    tables = torch.arange(b * m).view(1, b, m).expand(len(ex.windows), -1, -1).contiguous()
    _, aux = forward(ex, b, PENDING, context)()  # tap values of PENDING rows
    ids, pending = torch.randint(0, 100, (b, PENDING)), torch.full((b,), PENDING, dtype=torch.int64)
    cur = torch.full((b,), context + PENDING, dtype=torch.int64)
    return {"decode": forward(ex, b, 1, context), "verify": forward(ex, b, K + 1, context),
            "draft": lambda: ex.draft_parallel(ids, aux, pending, cur, tables, K)}


SMOKE = dict(shapes="tiny", context=16, repeats=2, warmup=1, num_calib=2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="tiny,h512", help="comma-separated: tiny, h512")
    p.add_argument("--context", type=int, default=256, help="positions each request has before the step")
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions (default tiny 50, h512 25)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads and onnxruntime intra-op threads")
    p.add_argument("--num-calib", type=int, default=16)
    p.add_argument("--interleave", action="store_true", help="alternate torch and onnxruntime run by run")


def run(args: argparse.Namespace) -> dict:
    from peagle_trt.checkpoint import load_pair
    from peagle_trt.executors.onnxruntime import OrtExecutor
    from peagle_trt.executors.torch import TorchExecutor
    from peagle_trt.export import ExportOptions, export_pair
    from peagle_trt.quantize import QuantizeOptions, quantize_target

    shapes = args.shapes.split(",")
    if set(shapes) - {"tiny", "h512"} or args.context + PENDING + K > MAX_SEQ_LEN:
        raise ConfigError(f"--shapes from tiny, h512; --context <= {MAX_SEQ_LEN - PENDING - K}")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    import modelopt.torch.quantization  # noqa: F401  (timed alone: its import is a fixed cost)
    stages, rows = [{"shape": "-", "stage": "import modelopt", "wall_s": round(time.perf_counter() - t0, 2)}], []
    options = ExportOptions(SpecConfig("peagle", K), max_batch=SLOTS, max_seq_len=MAX_SEQ_LEN)

    def stage(shape: str, name: str, fn) -> None:
        with stdout_to_stderr():  # the tokenizer trainer and ModelOpt print on fd 1
            stages.append({"shape": shape, "stage": name, "wall_s": round(timed(fn), 2)})

    with tempfile.TemporaryDirectory(prefix="bench-backends-") as tmp:
        for shape in shapes:
            root = Path(tmp) / shape
            with stdout_to_stderr():
                big = shape == "h512"
                target = tiny.make_target(root / "fp32", "llama", layers=8, **(H512 if big else {}))
                drafter = tiny.make_drafter(root / "drafter", target, "aws", draft_vocab=3072 if big else 384)
            calib = QuantizeOptions(num_calib=args.num_calib)
            stage(shape, "quantize fp8", lambda: quantize_target(target, root / "fp8", calib, progress=None))
            for precision in ("fp32", "fp8"):
                stage(shape, f"export {precision}", lambda: export_pair(root / precision, drafter,
                                                                        root / f"onnx-{precision}", options))
                models = load_pair(root / precision, drafter, SpecConfig("peagle", K)).build()
                executors = {"torch": TorchExecutor(*models, SLOTS, options.max_len),
                             "onnxruntime": OrtExecutor(root / f"onnx-{precision}", threads=args.threads)}
                repeats = args.repeats or (50 if shape == "tiny" else 25)
                for b in (1, 4):
                    with torch.inference_mode():
                        calls = {name: steps(ex, b, args.context) for name, ex in executors.items()}
                    for op in ("decode", "verify", "draft"):
                        fns = {name: torch.inference_mode()(c[op]) for name, c in calls.items()}
                        t = (alternate(fns, repeats, args.warmup) if args.interleave else  # else one at a time
                             {n: alternate({n: fn}, repeats, args.warmup)[n] for n, fn in fns.items()})
                        tt, oo = summary(t["torch"], 1e3), summary(t["onnxruntime"], 1e3)
                        rows.append({"shape": shape, "precision": precision, "op": op, "batch": b,
                                     "torch_ms": round(tt["median"], 3), "ort_ms": round(oo["median"], 3),
                                     "torch_spread": round(tt["spread"], 3), "ort_spread": round(oo["spread"], 3),
                                     "ort_over_torch": round(oo["median"] / tt["median"], 3)})
                        progress(f"[backends] {shape} {precision} B={b} {op}: torch {tt['median']:.2f} ms, "
                                 f"onnxruntime {oo['median']:.2f} ms")
    last = shapes[-1]
    figures = [Figure(f"onnxruntime over torch, {last} fp32 {r['op']} step, batch 1 (CPU)", r["ort_over_torch"], "x")
               for r in rows if (r["shape"], r["precision"], r["batch"]) == (last, "fp32", 1) and r["op"] != "draft"]
    return finish(args, "Backends on CPU: quantize, export, torch vs onnxruntime step time", [
        "### Stage times (wall s)", records(stages, ["shape", "stage", "wall_s"], 2),
        f"### Step time, median ms (context {args.context}, K = {K}, {args.threads} threads each, "
        f"{'interleaved' if args.interleave else 'blocked'})",
        records(rows, ["shape", "precision", "op", "batch", "torch_ms", "ort_ms", "ort_over_torch"], 2)],
        {"k": K, "pending": PENDING, "stages": stages,
         "order": "interleaved" if args.interleave else "blocked", "steps": rows}, figures)
