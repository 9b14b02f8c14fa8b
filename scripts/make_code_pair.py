#!/usr/bin/env python3
"""Make the project's real pair: a small Llama-style Python code model and its drafters.

What: (1) a byte-level BPE tokenizer trained on the Python source of the installed standard
library (`sysconfig.get_paths()["stdlib"]`, tests and site-packages excluded; never HumanEval);
(2) a Llama target (transformers LlamaForCausalLM) trained from scratch on the same files;
(3) a P-EAGLE head and an EAGLE-3 head for it, trained with `peagle-trt train` on the target's
own responses to stdlib prompts (a function's `def` line and docstring; the target writes the body).
Why: the random tiny models never accept a draft; this pair shows real acceptance and speed-up.
How: everything is seeded; weights are stored in bfloat16 (the loaders upcast) so the pair stays
small enough to keep in the source tree as tests/data/code-pair/ (3.8 MB).

    .venv/bin/python scripts/make_code_pair.py tests/data/code-pair             # all stages
    .venv/bin/python scripts/make_code_pair.py OUT --stage drafters              # reuse the target

Time and machine: see docs/BENCHMARKS.md ("Trained code pair"). The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from peagle_trt.bench.prompts import stdlib_files

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|reserved_mask|>"]
# A plain "chat" template: the user's text as is, so a code prompt is continued as code.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def function_prompts(n: int, seed: int, full_docstrings: float = 0.0) -> list[str]:
    """`n` prompts shaped like code-completion tasks: a stdlib function's `def` line(s) and its
    docstring, dedented (the drafters' training prompts; the target writes the bodies). A fraction
    `full_docstrings` keeps the whole multi-line docstring (HumanEval-shaped prompts), the rest only
    its first line (the corpus' shape)."""
    found = []
    rng = random.Random(seed + 1)
    for path in stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and len(node.body) > 1:
                node.body = node.body[:1]  # the def line(s) and the docstring
                node.decorator_list = []
                full = rng.random() < full_docstrings and "\n" in ast.get_docstring(node).strip()
                if not full:
                    node.body[0].value = ast.Constant(ast.get_docstring(node).strip().splitlines()[0].strip())
                text = ast.unparse(node)  # no trailing newline: see bench/measure.py's code_prompts, token healing
                if 40 <= len(text) <= (1200 if full else 400):
                    found.append(text)
    random.Random(seed).shuffle(found)
    return found[:n]


def normalized(source: str) -> str:
    """The code as `ast.unparse` writes it: no comments, one formatting style, docstrings cut to
    their first line. A far more regular corpus, which a small model learns in minutes."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and ast.get_docstring(node):
            first = ast.get_docstring(node).strip().splitlines()[0].strip()
            node.body[0].value = ast.Constant(first)
    return ast.unparse(tree) + "\n"


def corpus_texts(files: list[Path]) -> list[str]:
    texts = []
    for f in files:
        try:
            texts.append(normalized(f.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError, OSError):
            continue
    return texts


def make_tokenizer(out: Path, texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL[0], pad_token=SPECIAL[0],
                                   additional_special_tokens=SPECIAL[1:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def token_stream(fast, texts: list[str]) -> torch.Tensor:
    eos = fast.convert_tokens_to_ids(SPECIAL[0])
    ids: list[int] = []
    for text in texts:
        ids += fast(text, add_special_tokens=False)["input_ids"] + [eos]
    return torch.tensor(ids, dtype=torch.long)


def train_target(out: Path, args) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    texts = corpus_texts(stdlib_files())
    random.Random(args.seed).shuffle(texts)
    fast = make_tokenizer(out, texts, args.vocab)
    stream = token_stream(fast, texts)  # [N]
    held_out = stream[-args.seq_len * 64:]
    train = stream[:-args.seq_len * 64]
    print(f"[target] corpus: {len(texts)} files, {len(stream)} tokens, vocab {len(fast)} "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    eos = fast.convert_tokens_to_ids(SPECIAL[0])
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 32,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         tie_word_embeddings=False, eos_token_id=eos, bos_token_id=None, pad_token_id=eos)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    warmup = max(1, args.steps // 20)
    t1 = time.perf_counter()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train) - args.seq_len - 1, (args.batch,), generator=gen)
        batch = torch.stack([train[s:s + args.seq_len] for s in starts.tolist()])  # [B, T]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            rate = (step + 1) * args.batch * args.seq_len / (time.perf_counter() - t1)
            print(f"[target] step {step + 1}/{args.steps} loss {loss.item():.3f} lr {lr:.2e} "
                  f"{rate:.0f} tok/s", file=sys.stderr, flush=True)
    model.eval()
    model.to(torch.bfloat16)  # what we store and what the drafters are trained against
    with torch.no_grad():
        chunks = held_out[:len(held_out) // args.seq_len * args.seq_len].view(-1, args.seq_len)
        val = model.float()(input_ids=chunks, labels=chunks).loss.item()
    model.to(torch.bfloat16).save_pretrained(out)
    return {"target_params": n_params, "target_train_s": round(time.perf_counter() - t1, 1),
            "target_val_loss": round(val, 4), "corpus_tokens": len(stream), "corpus_files": len(texts)}


def train_drafters(out: Path, args) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "stdlib_prompts.jsonl"
    requests = function_prompts(args.prompts, args.seed, args.full_docstrings)
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in requests))
    procs = {}
    for method in args.methods.split(","):  # a fresh target: never resume heads trained for another
        shutil.rmtree(work / f"ckpt-{method}", ignore_errors=True)
    heads = (("peagle", ["--depths", str(args.depths), *shlex.split(args.peagle_args)]), ("eagle3", ["--depths", "5"]))
    for method, extra in (h for h in heads if h[0] in args.methods.split(",")):
        dest = out / f"drafter-{method}"
        cmd = [sys.executable, "-m", "peagle_trt.cli", "train", "--target", str(out), "--output", str(dest),
               "--method", method, "--data", str(prompts), "--no-chat-template",
               "--regen-max-tokens", str(args.regen_tokens), "--taps", args.taps, "--seq-len", "384",
               "--steps", str(args.drafter_steps), "--batch", str(args.drafter_batch),
               "--layers", str(args.drafter_layers), "--draft-vocab", str(args.draft_vocab),
               "--lr", str(args.drafter_lr), "--seed", str(args.seed), "--save-dtype", "bfloat16",
               "--checkpoint-dir", str(work / f"ckpt-{method}"), "--force", *extra]
        print(f"[drafters] {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
        # the two heads train side by side (one process each)
        procs[method] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True), time.perf_counter())
    results = {}
    for method, (proc, t0) in procs.items():
        stdout, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"training the {method} head failed (exit {proc.returncode})")
        results[method] = {**json.loads(stdout.strip().splitlines()[-1]), "wall_s": round(time.perf_counter() - t0, 1)}
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="output directory (target + drafter-peagle/ + drafter-eagle3/)")
    p.add_argument("--stage", default="all", choices=["all", "target", "drafters"])
    p.add_argument("--work", default="artifacts/code-pair-work", help="scratch directory (checkpoints)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=450)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--depths", type=int, default=10, help="P-EAGLE parallel depth trained")
    p.add_argument("--prompts", type=int, default=1500, help="drafter training prompts (stdlib def + docstring)")
    p.add_argument("--full-docstrings", type=float, default=0.5,
                   help="fraction of prompts keeping their whole (multi-line) docstring")
    p.add_argument("--methods", default="peagle,eagle3", help="heads to train (comma-separated)")
    p.add_argument("--peagle-args", default="--down-sample-ratio-min 0.3",
                   help="extra `peagle-trt train` options for the P-EAGLE head")
    p.add_argument("--regen-tokens", type=int, default=96, help="response tokens the target writes per prompt")
    p.add_argument("--taps", default="1,2,3", help="target tap layers feeding the drafters")
    p.add_argument("--drafter-layers", type=int, default=1)
    p.add_argument("--drafter-steps", type=int, default=1500)
    p.add_argument("--drafter-batch", type=int, default=8)
    p.add_argument("--drafter-lr", type=float, default=3e-3)
    p.add_argument("--draft-vocab", type=int, default=512)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    info: dict = {"out": str(args.out)}
    if args.stage in ("all", "target"):
        info["target"] = train_target(args.out, args)
    if args.stage in ("all", "drafters"):
        info["drafters"] = train_drafters(args.out, args)
    info["total_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
