"""`peagle-trt train`: the command line of the training stage (wired into peagle_trt/cli.py).

    peagle-trt train --target TARGET_DIR --output HEAD_DIR --text-list FILES.txt [--method peagle]
    peagle-trt train --target TARGET_DIR --output HEAD_DIR --data prompts.jsonl --method eagle3
    peagle-trt train ... --data answers.jsonl --device cuda --online --wall-budget-s 200 --source-tokens 8000000
    (the GPU run of SmolLM2's heads in one script: scripts/gpu_train.sh; its recipe peagle_trt/train/gpu_recipe.py)

Progress (loss, per-depth top-1 agreement with the target, tokens/s) goes to stderr; the last
stdout line (printed by peagle_trt/cli.py) is the summary dict.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from peagle_trt.errors import ConfigError


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `train` on an argparse subparsers object; sets func=cmd_train."""
    t = sub.add_parser("train", help="train a P-EAGLE (or sequential EAGLE-3) drafter head for a target")
    t.add_argument("--target", required=True, type=Path,
                   help="target model: a Hugging Face model directory or hub id (org/name[@revision])")
    t.add_argument("--output", required=True, type=Path, help="drafter directory to write")
    t.add_argument("--method", default="peagle", choices=["peagle", "eagle3"],
                   help="peagle: parallel head (mask token + mask_hidden); eagle3: sequential baseline")
    t.add_argument("--layout", default="aws", choices=["aws", "speculators"], help="output layout (default aws)")
    t.add_argument("--data", type=Path, help="JSONL of prompts (the target answers them now) or of the "
                   "target's answers (prompt_ids/response_ids rows of train/distill.py)")
    t.add_argument("--text", type=Path, action="append", default=[],
                   help="plain text file (repeatable); beside --data, extra training data: the target's "
                        "distributions over it in pieces of up to 1024 tokens (teacher-forced, no generation)")
    t.add_argument("--text-list", type=Path, help="a file listing plain text files, one path a line")
    t.add_argument("--text-piece", default=None,
                   help="beside --data: cut the text into pieces of N tokens (default 1024, at most --seq-len); "
                        "several sizes, comma-separated, are taken in turn (8192,8192,4096: long-context pieces)")
    t.add_argument("--held-out-text-list", type=Path, default=None,
                   help="beside --data: text files (a listing) cut like --text-piece, never trained on: a second "
                        "held-out curve (curve rows' top1_text, and top1_text_by_position per 2K positions)")
    t.add_argument("--regen-max-tokens", type=int, default=128, help="response tokens regenerated per prompt")
    t.add_argument("--regen-temperature", type=float, default=0.0, help="0 = greedy responses (default)")
    t.add_argument("--no-chat-template", action="store_true", help="encode --data prompts as raw text")
    t.add_argument("--depths", type=int, default=8,
                   help="P-EAGLE: parallel depth trained (K up to this); EAGLE-3: training-time-test steps")
    t.add_argument("--down-sample-ratio", type=float, default=0.7, help="COD ratio r (depth d keeps r^d)")
    t.add_argument("--down-sample-ratio-min", type=float, default=0.2, help="COD floor r_min")
    t.add_argument("--segments", type=int, default=1, help="sequence partitions (bounded memory on long sequences)")
    t.add_argument("--segment-tokens", type=int, default=None,
                   help="more partitions for long sequences: at most about N tokens each")
    t.add_argument("--max-context", type=int, default=None,
                   help="--data: keep only the last N prompt tokens before each response")
    t.add_argument("--feature-cache", type=Path, default=None,
                   help="file keeping the target's pass over whole sequences (float16, by content), reused by "
                        "later runs on the same target (e.g. a P-EAGLE and an EAGLE-3 head; a run on more data "
                        "passes only the new sequences)")
    t.add_argument("--fc-norm", action="store_true",
                   help="one RMSNorm per target tap before fc (taps whose scales differ widely, e.g. SmolLM2's)")
    t.add_argument("--freeze-embeddings", action="store_true",
                   help="P-EAGLE: keep the target's embedding table (the head then ships none; smaller)")
    t.add_argument("--layers", type=int, default=1, help="drafter layers (default 1)")
    t.add_argument("--intermediate-size", type=int, default=None, help="drafter MLP width (default: the target's)")
    t.add_argument("--draft-vocab", type=int, default=None, help="draft vocabulary size (default: whole vocabulary)")
    t.add_argument("--taps", default=None, help="three target tap layers, e.g. 1,2,3 (default: the target's)")
    t.add_argument("--mask-token-id", type=int, default=None, help="reserved mask token (default: from the tokenizer)")
    t.add_argument("--steps", type=int, default=100)
    t.add_argument("--batch", type=int, default=4, help="sequences per step")
    t.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (longer ones are cut)")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=None, help="warm-up steps (default steps/20)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cpu", help="torch device (cpu or cuda)")
    t.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    t.add_argument("--held-out-every", type=int, default=50,
                   help="--data: hold out every Nth sequence (never trained on) for the learning curve (0: none)")
    t.add_argument("--train-sequences", type=int, default=None,
                   help="--data: train on the first N sequences that are not held out (a data-size study)")
    t.add_argument("--train-from", type=int, default=0,
                   help="--data: skip the first N sequences that are not held out (with --init-from: continue a "
                        "head on the newest answers; the held-out set stays every --held-out-every-th of all)")
    t.add_argument("--eval-every", type=int, default=50,
                   help="held-out per-depth top-1 every N steps (curve.jsonl and curve.png beside the head; 0: never)")
    t.add_argument("--eval-len", type=int, default=512, help="held-out sequences cut to their first N tokens")
    t.add_argument("--curriculum", type=int, default=0, help="train depth 0 only for the first N steps")
    t.add_argument("--cpu-budget-s", type=float, default=None,
                   help="stop after this much training CPU time (process time); the cosine schedule spans it")
    t.add_argument("--wall-budget-s", type=float, default=None,
                   help="stop after this much training wall time (a GPU run); the cosine schedule spans it")
    t.add_argument("--online", action="store_true",
                   help="the target's pass over each step's batch at once (a GPU run), instead of a feature cache")
    t.add_argument("--depth-weights", default=None,
                   help="per-depth loss weights, one per --depths, comma-separated (default 1 each)")
    t.add_argument("--source-tokens", type=int, default=0,
                   help="--data: and up to N tokens of Python source (--source-root, default this interpreter's "
                        "site-packages), teacher-forced in pieces (train/source.py)")
    t.add_argument("--source-root", type=Path, action="append", default=[],
                   help="a folder of .py files for --source-tokens (repeatable)")
    t.add_argument("--init-from", type=Path, default=None,
                   help="warm start from a trained head (same shapes and draft vocabulary), e.g. a shipped one; "
                        "with more --layers than it has, the added layers start as identity (grown)")
    t.add_argument("--init-layer", default="random", choices=["random", "target"],
                   help="target: the drafter layer starts as the target's last layer (on its hidden half)")
    t.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="resumable training state; a run finds and continues the one there")
    t.add_argument("--save-every", type=int, default=50, help="checkpoint interval in steps")
    t.add_argument("--log-every", type=int, default=10, help="progress line kept every N steps")
    t.add_argument("--force", action="store_true", help="replace an existing --output")
    t.set_defaults(func=cmd_train)
    return t


def comma_list(text: str | None, kind: type, flag: str, expected: str) -> tuple | None:
    """`text` ("1,2,3") as a tuple of `kind`, None when it is empty; ConfigError "FLAG 'TEXT': EXPECTED"
    when an item is not a `kind` (--taps, --depth-weights here and in peagle_trt/train/gpu_recipe.py)."""
    if not text:
        return None
    try:
        return tuple(kind(x) for x in text.split(","))
    except ValueError as exc:
        raise ConfigError(f"{flag} {text!r}: {expected}") from exc


def cmd_train(args: argparse.Namespace) -> dict:
    from peagle_trt import hub
    from peagle_trt.train import TrainConfig, train

    args.target = hub.resolve(args.target, what="--target")
    if args.init_from is not None:
        args.init_from = hub.resolve(args.init_from, what="--init-from")
    text = list(args.text)
    if args.text_list:
        if not args.text_list.is_file():
            raise ConfigError(f"--text-list {args.text_list} does not exist")
        text += [Path(line.strip()) for line in args.text_list.read_text().splitlines() if line.strip()]
    held_text = ()
    if args.held_out_text_list:
        if not args.held_out_text_list.is_file():
            raise ConfigError(f"--held-out-text-list {args.held_out_text_list} does not exist")
        held_text = tuple(Path(line.strip()) for line in args.held_out_text_list.read_text().splitlines()
                          if line.strip())
    pieces = comma_list(args.text_piece, int, "--text-piece", "expected token counts, e.g. 8192 or 8192,4096")
    taps = comma_list(args.taps, int, "--taps", "expected three comma-separated layer ids, e.g. 1,2,3")
    weights = comma_list(args.depth_weights, float, "--depth-weights", "expected numbers, e.g. 1,1,0.8")
    cfg = TrainConfig(target=args.target, output=args.output, method=args.method, data=args.data,
                      text=tuple(text), text_piece=pieces, held_out_text=held_text, layout=args.layout,
                      depths=args.depths,
                      down_sample_ratio=args.down_sample_ratio, down_sample_ratio_min=args.down_sample_ratio_min,
                      segments=args.segments, segment_tokens=args.segment_tokens, max_context=args.max_context,
                      freeze_embeddings=args.freeze_embeddings, feature_cache=args.feature_cache,
                      fc_norm=args.fc_norm,
                      layers=args.layers,
                      intermediate_size=args.intermediate_size,
                      draft_vocab=args.draft_vocab, taps=taps, mask_token_id=args.mask_token_id,
                      steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr, warmup=args.warmup,
                      seed=args.seed, regen_max_tokens=args.regen_max_tokens,
                      regen_temperature=args.regen_temperature, chat_template=not args.no_chat_template,
                      device=args.device, save_dtype=args.save_dtype, checkpoint_dir=args.checkpoint_dir,
                      save_every=args.save_every, log_every=args.log_every, force=args.force,
                      held_out_every=args.held_out_every, eval_every=args.eval_every, eval_len=args.eval_len,
                      curriculum=args.curriculum, cpu_budget_s=args.cpu_budget_s, init_from=args.init_from,
                      init_layer=args.init_layer, train_sequences=args.train_sequences,
                      train_from=args.train_from, wall_budget_s=args.wall_budget_s, online=args.online,
                      depth_weights=weights, source_tokens=args.source_tokens,
                      source_roots=tuple(args.source_root))
    return train(cfg)
