"""Suite `backends` (docs/BENCHMARKS.md, "backends"): on CPU, per model shape (Llama target + AWS-layout
P-EAGLE drafter, random seeded weights): the FP8 quantize time (ModelOpt PTQ, `quantize_target`; its
import timed once, alone), the ONNX export time of the fp32 and FP8 targets (`export_pair`, K = 7),
and one step of each kind on the torch executor vs the onnxruntime executor (batch 1 and 4, after a
--context prefill): decode (1 row), verify (K+1 rows), draft (`draft_parallel`: 4 pending + K-1 mask
rows). The backends run one block after the other by default: alternated run by run on 2 cores
each library's spinning thread pool slows the other (--interleave shows it). Shapes: `tiny`
(hidden 64) and `h512` (hidden 512, 8 layers, 8 / 4 heads, vocab 4096; tiny's drafter geometry at
hidden 512, draft vocab 3072). FP8 on CPU is emulated: slower than fp32 here, not a GPU forecast.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from peagle_trt import tiny
from peagle_trt.bench.harness import Figure, alternate, finish, progress, stdout_to_stderr, summary, table
from peagle_trt.checkpoint import load_pair
from peagle_trt.config import SpecConfig
from peagle_trt.errors import ConfigError
from peagle_trt.executors.onnxruntime import OrtExecutor
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.export import ExportOptions, export_pair
from peagle_trt.quantize import QuantizeOptions, quantize_target

K = 7
NUM_SLOTS = 4
MAX_SEQ_LEN = 512
PENDING = 4  # pending rows of a draft pass (e.g. 3 accepted drafts + the bonus token)
BATCHES = (1, 4)
OPS = ("decode", "verify", "draft")
H512 = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
            head_dim=64, initializer_range=0.02)


def make_shape(name: str, root: Path) -> tuple[Path, Path]:
    if name not in ("tiny", "h512"):
        raise ConfigError(f"unknown shape {name!r} (tiny | h512)")
    target = tiny.make_target(root / "target", "llama", layers=8, **(H512 if name == "h512" else {}))
    return target, tiny.make_drafter(root / "drafter", target, "aws", draft_vocab=3072 if name == "h512" else 384)


class Steps:
    """The three step kinds on one executor, batch B, after a CONTEXT-position prefill."""

    def __init__(self, ex, batch: int, context: int, vocab: int, gen: torch.Generator):
        self.ex, self.b, self.ctx = ex, batch, context
        m = ex.kv.max_blocks  # request b holds blocks b*M .. b*M + M - 1 of every group
        self.slots = (torch.arange(batch)[:, None] * m + torch.arange(m)).expand(len(ex.windows), -1, -1).contiguous()
        prompt = torch.randint(0, vocab, (batch, context), generator=gen)
        positions = torch.arange(context).expand(batch, -1).contiguous()
        last = torch.full((batch, 1), context - 1, dtype=torch.int64)
        _, aux = ex.target(prompt, positions, self.slots, last)  # target KV 0 .. ctx-1
        n = torch.full((batch,), context, dtype=torch.int64)
        ex.draft_parallel(prompt, aux, n, n.clone(), self.slots, K)  # drafter KV 0 .. ctx-1
        self.decode_in = (torch.randint(0, vocab, (batch, 1), generator=gen),
                          torch.full((batch, 1), context, dtype=torch.int64))
        self.verify_in = (torch.randint(0, vocab, (batch, K + 1), generator=gen),
                          (context + torch.arange(K + 1)).expand(batch, -1).contiguous())
        self.all_rows = torch.arange(K + 1).expand(batch, -1).contiguous()
        self.first_row = torch.zeros((batch, 1), dtype=torch.int64)
        self.draft_ids = torch.randint(0, vocab, (batch, PENDING), generator=gen)
        self.draft_aux = aux[:, -PENDING:].contiguous()  # realistic tap values
        self.num_pending = torch.full((batch,), PENDING, dtype=torch.int64)
        self.cur = torch.full((batch,), context + PENDING, dtype=torch.int64)

    def run(self, op: str):
        ex = self.ex
        if op == "decode":
            return ex.target(*self.decode_in, self.slots, self.first_row)
        if op == "verify":
            return ex.target(*self.verify_in, self.slots, self.all_rows)
        return ex.draft_parallel(self.draft_ids, self.draft_aux, self.num_pending, self.cur, self.slots, K)


def bench_steps(shape: str, precision: str, target_dir: Path, drafter_dir: Path, export_dir: Path,
                context: int, repeats: int, warmup: int, ort_threads: int, vocab: int, interleave: bool) -> list[dict]:
    target, drafter = load_pair(target_dir, drafter_dir, SpecConfig("peagle", K)).build()
    spec = ExportOptions(SpecConfig("peagle", K), max_batch=NUM_SLOTS, max_seq_len=MAX_SEQ_LEN)
    rows = []
    for batch in BATCHES:
        steps = {"torch": Steps(TorchExecutor(target, drafter, NUM_SLOTS, spec.max_len), batch, context, vocab,
                                torch.Generator().manual_seed(batch)),
                 "onnxruntime": Steps(OrtExecutor(export_dir, threads=ort_threads), batch, context, vocab,
                                      torch.Generator().manual_seed(batch))}
        for op in OPS:
            fns = {name: (lambda st=st: st.run(op)) for name, st in steps.items()}
            with torch.inference_mode():
                if interleave:  # run by run (see the module docstring)
                    t = alternate(fns, repeats, warmup)
                else:  # one backend at a time, each after its own warm-up
                    t = {name: alternate({name: fn}, repeats, warmup)[name] for name, fn in fns.items()}
            tt, oo = summary(t["torch"], 1e3), summary(t["onnxruntime"], 1e3)
            row = dict(shape=shape, precision=precision, op=op, batch=batch,
                       rows_per_request={"decode": 1, "verify": K + 1, "draft": PENDING + K - 1}[op],
                       torch_ms=round(tt["median"], 3), ort_ms=round(oo["median"], 3),
                       torch_spread=round(tt["spread"], 3), ort_spread=round(oo["spread"], 3),
                       ort_over_torch=round(oo["median"] / tt["median"], 3), repeats=repeats, warmup=warmup)
            rows.append(row)
            progress(f"  [{shape} {precision} B={batch}] {op:<6s} torch {row['torch_ms']:8.2f} ms   "
                     f"onnxruntime {row['ort_ms']:8.2f} ms   ratio {row['ort_over_torch']:.2f}")
    return rows


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shapes", default="tiny,h512", help="comma-separated: tiny, h512")
    ap.add_argument("--context", type=int, default=256, help="positions prefilled before the steps")
    ap.add_argument("--repeats", type=int, default=None, help="timed repetitions (default tiny 50, h512 25)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads and onnxruntime intra-op threads")
    ap.add_argument("--num-calib", type=int, default=16)
    ap.add_argument("--interleave", action="store_true",
                    help="alternate torch and onnxruntime run by run (shows the thread contention)")


def run(args: argparse.Namespace) -> dict:
    if args.smoke:  # the tiny shape, a short context, a few repeats and calibration prompts
        args.shapes, args.context, args.repeats, args.warmup, args.num_calib = "tiny", 16, 2, 1, 2
    if args.context + PENDING + K > MAX_SEQ_LEN:
        raise ConfigError(f"--context must be <= {MAX_SEQ_LEN - PENDING - K}")
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    import modelopt.torch.quantization  # noqa: F401  (timed alone: its import is a fixed cost)
    modelopt_import_s = time.perf_counter() - t0
    stages, steps = [], []
    with tempfile.TemporaryDirectory(prefix="bench-backends-") as tmp:
        for shape in shapes:
            root = Path(tmp) / shape
            with stdout_to_stderr():  # the tokenizer trainer draws its progress on fd 1
                target_dir, drafter_dir = make_shape(shape, root)
            vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
            t0 = time.perf_counter()
            with stdout_to_stderr():
                manifest = quantize_target(target_dir, root / "target-fp8",
                                           QuantizeOptions(num_calib=args.num_calib), progress=None)
            stages.append(dict(shape=shape, stage="quantize", precision="fp8",
                               wall_s=round(time.perf_counter() - t0, 2),
                               calibrate_s=manifest["timings"]["calibrate_s"]))
            exports = {}
            for precision, tdir in (("fp32", target_dir), ("fp8", root / "target-fp8")):
                out = root / f"export-{precision}"
                t0 = time.perf_counter()
                export_pair(tdir, drafter_dir, out, ExportOptions(SpecConfig("peagle", K), max_batch=NUM_SLOTS,
                                                                  max_seq_len=MAX_SEQ_LEN))
                stages.append(dict(shape=shape, stage="export", precision=precision,
                                   wall_s=round(time.perf_counter() - t0, 2),
                                   bytes=sum(p.stat().st_size for p in out.rglob("*") if p.is_file())))
                exports[precision] = (tdir, out)
            progress(f"[{shape}] stages: " + ", ".join(f"{x['stage']} {x['precision']} {x['wall_s']} s"
                                                       for x in stages if x["shape"] == shape))
            repeats = args.repeats or (50 if shape == "tiny" else 25)
            for precision, (tdir, out) in exports.items():
                steps += bench_steps(shape, precision, tdir, drafter_dir, out, args.context, repeats,
                                     args.warmup, args.threads, vocab, args.interleave)
    stage_rows = [["-", "import", "-", f"{modelopt_import_s:.2f} (modelopt.torch.quantization)"]]
    stage_rows += [[x["shape"], x["stage"], x["precision"], f"{x['wall_s']:.2f}"] for x in stages]
    big = shapes[-1]
    figures = [Figure(f"onnxruntime over torch, {big} fp32 {r['op']} step, batch {r['batch']} (CPU)",
                      r["ort_over_torch"], "x") for r in steps
               if (r["shape"], r["precision"], r["batch"]) == (big, "fp32", 1) and r["op"] in ("decode", "verify")]
    sections = ["### Stage times (wall s)", table(["shape", "stage", "target", "wall s"], stage_rows),
                (f"### Step time, median ms (context {args.context}, K = {K}, {args.threads} threads each, "
                 f"{'interleaved' if args.interleave else 'blocked'})"),
                table(["shape", "target", "op", "B", "rows/req", "torch ms", "ort ms", "ort/torch"],
                      [[r["shape"], r["precision"], r["op"], r["batch"], r["rows_per_request"], f"{r['torch_ms']:.2f}",
                        f"{r['ort_ms']:.2f}", f"{r['ort_over_torch']:.2f}"] for r in steps])]
    return finish(args, "Backends on CPU: quantize, export, torch vs onnxruntime step time", sections,
                  dict(modelopt_import_s=round(modelopt_import_s, 3), context=args.context, k=K, pending=PENDING,
                       max_batch=NUM_SLOTS, max_seq_len=MAX_SEQ_LEN, threads=args.threads,
                       order="interleaved" if args.interleave else "blocked", stages=stages, steps=steps), figures)
