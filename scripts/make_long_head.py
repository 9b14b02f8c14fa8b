#!/usr/bin/env python3
"""Make a long-context P-EAGLE head for SmolLM2-135M-Instruct: the shipped head continued on long pieces.

What: the shipped head (tests/data/smollm2-heads/peagle) was trained on sequences of at most 2K
tokens (answers, 1K-token pieces of source). This continues it (`peagle-trt train --init-from`,
the same --draft-vocab 8192 --depths 5 --freeze-embeddings --fc-norm flags) with --seq-len 8192 on

  - long pieces of Python source (`--text-piece`, default 8192,8192,8192,4096 in turn) cut from
    training-split module sources of --min-bytes..--max-bytes (peagle_trt/train/instructions.py
    `source_files`, the standard library; mostly one module a piece), teacher-forced;
  - the shipped answers (data/smollm2-135m-instruct/answers.jsonl.gz) so short-context acceptance
    is kept: --answers training answers spread evenly over the file, whole prompts (--max-context
    2048: no prompt is cut), interleaved with every other of the card's held-out answers (rows
    i % 50 == 49, every 100th row) so that `--held-out-every 3` holds out exactly those;
  - a second held-out curve (`--held-out-text-list`): the next training-split modules' source cut
    the same way (never trained on; not the long-context benchmark's held-out split), its top-1
    by position also per 2K span of context (curve rows' top1_text_by_position).

Partitions of --segment-tokens 1024 keep each backward pass to 1K positions of chains. The target's
pass (features) is cached in WORK/features.pt (+ parts, saved every 5 minutes) and the training
state in WORK/ckpt: running the same command again resumes both. Outputs in WORK (not in git):
answers.jsonl, long-train.txt, long-heldout.txt, drafter-peagle-long/ (the head, curve.jsonl,
curve.png), train.log.

    .venv/bin/python scripts/make_long_head.py WORK --wall-budget-s 1500     # prepare + train (resumable)
    .venv/bin/python scripts/make_long_head.py WORK --stage prepare         # only the data files

On 2 shared CPU cores the target's pass over one 8K piece costs ~200 CPU s (~5 wall minutes under
load: attention over the cache is quadratic, and 135M parameters times 8K tokens is ~2 TFLOP);
threads: --threads (OMP_NUM_THREADS of the training process; 1 on a shared machine, where two spin).
Last stdout line: JSON.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ANSWERS = REPO / "data" / "smollm2-135m-instruct" / "answers.jsonl.gz"
SHIPPED = REPO / "tests" / "data" / "smollm2-heads" / "peagle"
HELD_EVERY = 50  # the card's held-out split of the answers (`peagle-trt train --held-out-every 50`)
FLAGS = ["--draft-vocab", "8192", "--depths", "5", "--seq-len", "8192", "--segment-tokens", "1024",
         "--max-context", "2048", "--eval-len", "1024", "--batch", "4", "--warmup", "10", "--freeze-embeddings",
         "--fc-norm", "--mask-token-id", "4", "--save-dtype", "bfloat16", "--log-every", "5", "--save-every", "10",
         "--steps", "1000000", "--held-out-every", "3"]


def note(msg: str) -> None:
    print(f"[long-head] {msg}", file=sys.stderr, flush=True)


def answers_file(out: Path, train_answers: int) -> dict:
    """Rows of the shipped answers: `train_answers` training rows spread evenly, and after every
    two of them one of the card's held-out rows (every other: rows i % 100 == 99)."""
    with gzip.open(ANSWERS, "rt", encoding="utf-8") as f:
        rows = [line for line in f.read().splitlines() if line.strip()]
    held = [r for i, r in enumerate(rows) if i % HELD_EVERY == HELD_EVERY - 1][1::2]
    train = [r for i, r in enumerate(rows) if i % HELD_EVERY != HELD_EVERY - 1]
    pick = [train[k * len(train) // train_answers] for k in range(train_answers)]
    lines = []
    for k in range(max(len(held), -(-len(pick) // 2))):
        lines += pick[2 * k:2 * k + 2]
        if k < len(held) and len(pick) >= 2 * k + 2:
            lines.append(held[k])
    out.write_text("".join(line + "\n" for line in lines))
    return {"train_answers": len(pick), "held_out_answers": sum(1 for line in lines if line in set(held))}


def source_lists(work: Path, long_tokens: int, held_tokens: int, min_bytes: int, max_bytes: int) -> dict:
    """The training and held-out modules: training-split sources of min_bytes..max_bytes (about one
    long piece each, so the pieces are many modules), in `source_files`' seeded order."""
    from peagle_trt.train.instructions import source_files

    pool = [p for p in source_files(10_000_000, min_bytes=min_bytes)  # not the codecs' generated tables
            if p.stat().st_size <= max_bytes and p.parent.name != "encodings"]
    lists: list[list[Path]] = [[], []]
    for files, budget in zip(lists, (long_tokens, held_tokens)):
        tokens = 0.0
        while pool and tokens < budget:
            files.append(pool.pop(0))
            tokens += files[-1].stat().st_size / 3.2
    (work / "long-train.txt").write_text("".join(f"{p}\n" for p in lists[0]))
    (work / "long-heldout.txt").write_text("".join(f"{p}\n" for p in lists[1]))
    return {"long_train_files": [p.name for p in lists[0]], "long_heldout_files": [p.name for p in lists[1]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--stage", choices=("prepare", "train", "all"), default="all")
    ap.add_argument("--answers", type=int, default=222, help="training answers beside the long pieces")
    ap.add_argument("--long-tokens", type=int, default=29_000, help="about this many tokens of long source pieces")
    ap.add_argument("--held-tokens", type=int, default=12_000,
                    help="and this many of held-out source (at least one 8K piece)")
    ap.add_argument("--min-bytes", type=int, default=26_000, help="modules of at least this size (~8K tokens)")
    ap.add_argument("--max-bytes", type=int, default=40_000, help="and at most this size (about one piece each)")
    ap.add_argument("--pieces", default="8192,8192,8192,4096", help="--text-piece sizes, in turn")
    ap.add_argument("--lr", default="3e-4")
    ap.add_argument("--eval-every", default="40")
    ap.add_argument("--wall-budget-s", type=float, default=1500, help="training wall seconds (the cosine spans them)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--init-from", type=Path, default=SHIPPED)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    if args.stage in ("prepare", "all"):
        report.update(answers_file(args.work / "answers.jsonl", args.answers))
        report.update(source_lists(args.work, args.long_tokens, args.held_tokens, args.min_bytes, args.max_bytes))
        note(json.dumps(report))
    if args.stage in ("train", "all"):
        from peagle_trt.convert.packaged import cached_target

        cmd = [sys.executable, "-m", "peagle_trt.cli", "train", "--target", str(cached_target("smollm2")),
               "--data", str(args.work / "answers.jsonl"), "--text-list", str(args.work / "long-train.txt"),
               "--text-piece", args.pieces, "--held-out-text-list", str(args.work / "long-heldout.txt"),
               "--method", "peagle", "--layout", "aws", "--init-from", str(args.init_from),
               "--output", str(args.work / "drafter-peagle-long"), "--checkpoint-dir", str(args.work / "ckpt"),
               "--feature-cache", str(args.work / "features.pt"), "--lr", args.lr, "--eval-every", args.eval_every,
               "--wall-budget-s", str(args.wall_budget_s), "--force", *FLAGS]
        note(f"$ OMP_NUM_THREADS={args.threads} " + shlex.join(cmd))
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=env).stdout
        report["train"] = json.loads(out.strip().splitlines()[-1])
    print(json.dumps(report))


if __name__ == "__main__":
    main()
