"""Suite `backends` (docs/BENCHMARKS.md, "Backends on CPU"): FP8 quantize time, ONNX export time, and the
step time of the torch executor vs the onnxruntime executor, for fp32 and FP8 targets.

What, per model shape (Llama target + AWS-layout P-EAGLE drafter, random seeded weights):
  1. quantize  wall time of `quantize_target(target, out, QuantizeOptions(num_calib=16))` (ModelOpt FP8
               PTQ, calibration on the built-in prompts, HF export, reload check). The import of
               `modelopt.torch.quantization` is timed once, separately, before the first run (torch
               and transformers are already imported then, so it is ModelOpt's own import cost).
  2. export    wall time of `export_pair(target, drafter, out, ExportOptions(SpecConfig("peagle", 7),
               max_batch=4, max_seq_len=512))` for the fp32 and the FP8 target (checkpoint load +
               model build + all graphs + their TensorRT copies, written to disk).
  3. step      one forward of each kind on the torch executor (`TorchExecutor` over `pair.build()`)
               and on the onnxruntime executor (`OrtExecutor(export_dir, threads=2)`), batch 1 and 4,
               after a prefill has written CONTEXT (256) positions into the target and drafter KV
               caches of every request:
                 decode  target, 1 row per request at position ctx, logits for that row;
                 verify  target, K+1 = 8 rows per request at ctx .. ctx+7, logits for all 8 rows;
                 draft   `draft_parallel`: n = 4 pending rows at ctx .. ctx+3 plus K-1 = 6 mask
                         rows, K = 7 draft ids per request (ONE drafter forward).
               Each step rewrites the same cache positions, so repetitions are identical. The
               figure is the median of the repetitions (time.perf_counter) after warm-up. The two
               backends are timed one block after the other (torch, then onnxruntime, each after
               its own warm-up), NOT alternated run by run: alternated on 2 cores, torch's steps
               were 1.6-4.3x and onnxruntime's 1.2-1.7x slower (tiny shape), most likely because
               each library's thread pool keeps spinning for a while after its run and competes
               with the other's for the cores (`--interleave` reproduces it).

Shapes:
  tiny  `peagle_trt.tiny.make_target(dir, "llama", layers=8)` (hidden 64, 4 heads / 2 kv heads,
        head_dim 32, intermediate 128, vocab 512) + `make_drafter(dir, target, "aws")` (2 layers,
        hidden 64, 4 / 2 heads, head_dim 16, draft vocab 384).
  h512  a bigger random Llama target built here with transformers' LlamaConfig: hidden 512,
        8 layers, 8 heads / 4 kv heads, head_dim 64, intermediate 1536, vocab 4096 (the tiny BPE
        tokenizer is saved with it; its ids are < 512), llama3 rope as the tiny target; and an
        AWS-layout drafter for it: 2 layers, hidden 512, 8 / 4 heads, head_dim 64, intermediate
        1536, draft vocab 3072 (d2t / t2d over a random subset), mask_hidden, ptd_token_id.
        About 29 M target parameters (116 MB in fp32): still tiny next to a served model, but
        the GEMMs are large enough that per-node overheads no longer dominate.

Why: the onnxruntime executor is the default backend where TensorRT is missing, and FP8 is the
quantization this project ships. This puts numbers on what each stage costs on a CPU and on how
the exported graphs run in onnxruntime next to the reference torch models. It is NOT a forecast
for a GPU: on CPU, FP8 is emulated (torch `FP8Linear`: the activation is fake-quantized and the
FP8 weight is dequantized to float32 on every call; onnxruntime: QuantizeLinear / DequantizeLinear
on the activation around a float32 MatMul, the weight's DequantizeLinear being constant-folded
into a float32 initializer when the session is created), so the FP8 figures include extra work and
are expected to be slower than fp32 here. The drafter is never quantized: its `draft` figures
should not change with the target's precision.

Threads: torch.set_num_threads(2) and onnxruntime intra_op_num_threads = 2 (both printed).

Run (about 40 s on 2 idle cores, ~1.2 GB peak RSS, ~0.9 GB of temp files):
    peagle-trt bench backends
    peagle-trt bench backends --shapes tiny --repeats 30 --context 256
Output: progress on stderr, markdown tables on stdout, then as the LAST line one JSON object (env info + rows).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from peagle_trt import tiny
from peagle_trt.bench.common import cpu_counters, cpu_model, progress, stdout_to_stderr
from peagle_trt.bench.report import emit, markdown_table
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

H512 = dict(vocab=4096, hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, intermediate=1536,
             drafter_layers=2, draft_vocab=3072)


# -- models ------------------------------------------------------------------------------------
def make_h512_target(out: Path, seed: int = 0) -> Path:
    """The `h512` Llama target (see the module docstring), saved with the tiny tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    ids = tiny.make_tokenizer(out)
    s = H512
    config = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                         num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                         num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                         max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.02,
                         eos_token_id=ids["<|endoftext|>"], bos_token_id=None,
                         pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 256})
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(out)
    return out


def make_h512_drafter(out: Path, target_dir: Path, seed: int = 1) -> Path:
    """An AWS-layout P-EAGLE drafter for the `h512` target (random weights, seeded)."""
    from safetensors.torch import save_file

    from peagle_trt.checkpoint.drafter import DrafterConfig
    from peagle_trt.models.drafter import DrafterModel
    from peagle_trt.models.rope import RopeConfig

    s = H512
    out.mkdir(parents=True, exist_ok=True)
    config = DrafterConfig(layout="aws", hidden_size=s["hidden"], num_layers=s["drafter_layers"],
                           num_heads=s["heads"], num_kv_heads=s["kv_heads"], head_dim=s["head_dim"],
                           intermediate_size=s["intermediate"], rms_norm_eps=1e-6, rope=RopeConfig(10000.0),
                           vocab_size=s["vocab"], draft_vocab_size=s["draft_vocab"],
                           target_hidden_size=s["hidden"])
    torch.manual_seed(seed)
    state = DrafterModel(config).state_dict()
    tensors = {}
    for name, t in state.items():
        if name in ("d2t", "mask_hidden"):
            continue
        if name.startswith("layers.0."):  # the fusion midlayer is `midlayer.*` in the AWS layout
            name = "midlayer." + name[len("layers.0."):]
        tensors[name] = t.detach().clone().contiguous()
    kept = torch.sort(torch.randperm(s["vocab"])[:s["draft_vocab"]]).values
    tensors["d2t"] = kept - torch.arange(s["draft_vocab"])  # target_id = draft_id + d2t[draft_id]
    t2d = torch.zeros(s["vocab"], dtype=torch.bool)
    t2d[kept] = True
    tensors["t2d"] = t2d
    tensors["mask_hidden"] = torch.randn(1, 1, 3 * s["hidden"])
    added = json.loads((target_dir / "tokenizer.json").read_text())["added_tokens"]
    mask_id = next(t["id"] for t in added if t["content"] == tiny.MASK_TOKEN)
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": s["hidden"],
           "num_hidden_layers": s["drafter_layers"], "num_attention_heads": s["heads"],
           "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"],
           "intermediate_size": s["intermediate"], "rms_norm_eps": 1e-6, "hidden_act": "silu",
           "rope_theta": 10000.0, "max_position_embeddings": 4096, "vocab_size": s["vocab"],
           "draft_vocab_size": s["draft_vocab"], "target_hidden_size": s["hidden"], "ptd_token_id": mask_id}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def make_shape(name: str, root: Path) -> tuple[Path, Path]:
    if name == "tiny":
        target = tiny.make_target(root / "target", "llama", layers=8)
        return target, tiny.make_drafter(root / "drafter", target, "aws")
    if name == "h512":
        target = make_h512_target(root / "target")
        return target, make_h512_drafter(root / "drafter", target)
    raise ConfigError(f"unknown shape {name!r} (tiny | h512)")


# -- timing ------------------------------------------------------------------------------------
def other_share(before, after) -> float | None:
    """Share of all CPU time between two samples that OTHER processes (or steal) used."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return max((after[1] - before[1]) - (after[2] - before[2]), 0.0) / (after[0] - before[0])


def ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def block(steps, op: str, repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        steps.run(op)
    return [ms(lambda: steps.run(op)) for _ in range(repeats)]


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
                context: int, repeats: int, warmup: int, ort_threads: int, vocab: int,
                interleave: bool, prefills: list) -> list[dict]:
    pair = load_pair(target_dir, drafter_dir, SpecConfig("peagle", K))
    target, drafter = pair.build()
    spec = ExportOptions(SpecConfig("peagle", K), max_batch=NUM_SLOTS, max_seq_len=MAX_SEQ_LEN)
    rows = []
    for batch in BATCHES:
        gen_t, gen_o = torch.Generator().manual_seed(batch), torch.Generator().manual_seed(batch)
        t0 = time.perf_counter()
        torch_ex = TorchExecutor(target, drafter, NUM_SLOTS, spec.max_len)
        torch_steps = Steps(torch_ex, batch, context, vocab, gen_t)
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        ort_steps = Steps(OrtExecutor(export_dir, threads=ort_threads), batch, context, vocab, gen_o)
        o_prefill = time.perf_counter() - t0
        prefills.append(dict(shape=shape, precision=precision, batch=batch, torch_s=round(t_prefill, 3),
                             ort_s_incl_session=round(o_prefill, 3)))
        progress(f"  [{shape} {precision} B={batch}] prefill {context} pos (target + drafter): torch "
                 f"{t_prefill:.2f} s, onnxruntime {o_prefill:.2f} s (incl. session creation)")
        for op in OPS:
            with torch.inference_mode():
                before = cpu_counters()
                if interleave:  # torch and onnxruntime alternate (see the module docstring)
                    for _ in range(warmup):
                        torch_steps.run(op)
                        ort_steps.run(op)
                    t_ms, o_ms = [], []
                    for _ in range(repeats):
                        t_ms.append(ms(lambda: torch_steps.run(op)))
                        o_ms.append(ms(lambda: ort_steps.run(op)))
                else:  # one backend at a time, each block after its own warm-up
                    t_ms = block(torch_steps, op, repeats, warmup)
                    o_ms = block(ort_steps, op, repeats, warmup)
                share = other_share(before, cpu_counters())
            row = dict(shape=shape, precision=precision, op=op, batch=batch,
                       rows_per_request={"decode": 1, "verify": K + 1, "draft": PENDING + K - 1}[op],
                       torch_ms=round(statistics.median(t_ms), 3), ort_ms=round(statistics.median(o_ms), 3),
                       torch_ms_min=round(min(t_ms), 3), ort_ms_min=round(min(o_ms), 3),
                       repeats=repeats, warmup=warmup,
                       other_cpu_share=None if share is None else round(share, 3))
            row["ort_over_torch"] = round(row["ort_ms"] / row["torch_ms"], 3)
            rows.append(row)
            progress(f"  [{shape} {precision} B={batch}] {op:<6s} torch {row['torch_ms']:8.2f} ms   "
                     f"onnxruntime {row['ort_ms']:8.2f} ms   ratio {row['ort_over_torch']:.2f}")
        torch_steps = ort_steps = None  # free both backends before the next shape
    return rows


# -- environment -------------------------------------------------------------------------------
def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def mem_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


# -- main --------------------------------------------------------------------------------------
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
    started = time.perf_counter()
    env = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               python=platform.python_version(), torch=torch.__version__,
               onnxruntime=version("onnxruntime"), onnx=version("onnx"), modelopt=version("nvidia-modelopt"),
               transformers=version("transformers"), cpu=cpu_model(), cores=os.cpu_count(), mem_gib=mem_gib(),
               torch_threads=torch.get_num_threads(), ort_intra_op_threads=args.threads,
               order="interleaved" if args.interleave else "blocked")
    progress(f"{env['date']}  {env['cpu']}  {env['cores']} cores  {env['mem_gib']} GiB")
    progress(f"python {env['python']}  torch {env['torch']}  onnxruntime {env['onnxruntime']}  "
             f"onnx {env['onnx']}  modelopt {env['modelopt']}  transformers {env['transformers']}")
    progress(f"torch threads {env['torch_threads']}  onnxruntime intra-op threads {env['ort_intra_op_threads']}")

    t0 = time.perf_counter()
    import modelopt.torch.quantization  # noqa: F401  (timed alone: its import is a fixed cost)
    modelopt_import_s = time.perf_counter() - t0
    progress(f"modelopt import (torch, transformers already loaded): {modelopt_import_s:.2f} s")

    stages, steps, prefills = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-backends-") as tmp:
        for shape in shapes:
            root = Path(tmp) / shape
            t0 = time.perf_counter()
            with stdout_to_stderr():  # the tokenizer trainer draws its progress on fd 1
                target_dir, drafter_dir = make_shape(shape, root)
            vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
            tensors = load_pair(target_dir, None, SpecConfig("none")).target.tensors
            n_params = sum(t.numel() for t in tensors.values())
            del tensors
            progress(f"[{shape}] models written in {time.perf_counter() - t0:.1f} s "
                     f"(target {n_params / 1e6:.1f} M params, vocab {vocab})")
            t0 = time.perf_counter()
            with stdout_to_stderr():
                manifest = quantize_target(target_dir, root / "target-fp8",
                                           QuantizeOptions(num_calib=args.num_calib), progress=None)
            q_s = time.perf_counter() - t0
            stages.append(dict(shape=shape, stage="quantize", precision="fp8", wall_s=round(q_s, 2),
                               calibrate_s=manifest["timings"]["calibrate_s"],
                               calib_samples=manifest["calibration"]["samples"],
                               calib_tokens=manifest["calibration"]["tokens"]))
            progress(f"[{shape}] quantize: {q_s:.2f} s (calibrate {manifest['timings']['calibrate_s']:.2f} s, "
                     f"{manifest['calibration']['samples']} samples)")
            exports = {}
            for precision, tdir in (("fp32", target_dir), ("fp8", root / "target-fp8")):
                out = root / f"export-{precision}"
                spec = ExportOptions(SpecConfig("peagle", K), max_batch=NUM_SLOTS, max_seq_len=MAX_SEQ_LEN)
                t0 = time.perf_counter()
                manifest = export_pair(tdir, drafter_dir, out, spec)
                e_s = time.perf_counter() - t0
                size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
                stages.append(dict(shape=shape, stage="export", precision=precision, wall_s=round(e_s, 2),
                                   graphs_s=manifest["export_s"], bytes=size))
                progress(f"[{shape}] export {precision}: {e_s:.2f} s ({size / 2**20:.1f} MiB on disk)")
                exports[precision] = (tdir, out)
            repeats = args.repeats or (50 if shape == "tiny" else 25)
            for precision, (tdir, out) in exports.items():
                steps += bench_steps(shape, precision, tdir, drafter_dir, out, args.context, repeats,
                                     args.warmup, args.threads, vocab, args.interleave, prefills)

    stage_rows = [["-", "import", "-", f"{modelopt_import_s:.2f} (modelopt.torch.quantization)"]]
    stage_rows += [[x["shape"], x["stage"], x["precision"], f"{x['wall_s']:.2f}"] for x in stages]
    total_s = time.perf_counter() - started
    emit(args, "\n".join([
        "## Stage times (wall s)", "", markdown_table(["shape", "stage", "target", "wall s"], stage_rows), "",
        (f"## Step time, median ms over the repetitions (context {args.context}, K = {K}, "
         f"{args.threads} threads each)"), "",
        markdown_table(["shape", "target", "op", "B", "rows/req", "torch ms", "ort ms", "ort/torch", "other CPU"],
                       [[r["shape"], r["precision"], r["op"], r["batch"], r["rows_per_request"],
                         f"{r['torch_ms']:.2f}", f"{r['ort_ms']:.2f}", f"{r['ort_over_torch']:.2f}",
                         "-" if r["other_cpu_share"] is None else f"{r['other_cpu_share']:.0%}"] for r in steps]),
        "", f"total {total_s:.0f} s"]))
    return dict(**env, modelopt_import_s=round(modelopt_import_s, 3), context=args.context, k=K,
                pending=PENDING, max_batch=NUM_SLOTS, max_seq_len=MAX_SEQ_LEN,
                shapes={"h512": H512} if "h512" in shapes else {}, total_s=round(total_s, 1),
                stages=stages, prefills=prefills, steps=steps, smoke=args.smoke)
