"""The GPU recipe for a target's heads: P-EAGLE (then EAGLE-3 beside it) trained online within a wall
budget, warm-started from shipped heads, and the held-out evaluation that judges the result.

    from peagle_trt.train.gpu_recipe import GpuRecipe, train_heads, evaluate_heads
    summary = train_heads(GpuRecipe(), target_dir, answers, out / "heads", "cuda", deadline_s=540)
    report = evaluate_heads(out / "heads", target_dir, answers)

Why a recipe of its own: on a GPU the cost that shapes a run is wall time, not steps. `online`
passes the target over each step's batch at once (TrainConfig.online: no feature cache), each
head's cosine spans its wall seconds (`wall_budget_s`), P-EAGLE keeps its budget while EAGLE-3
shrinks or is skipped (`head_budget`), and teacher-forced Python source of the machine's own
site-packages (peagle_trt/train/source.py) adds data beside the committed answers. The knobs
(`GpuRecipe`: layers 1/2/4, trainable embeddings, depths and per-depth loss weights, batch, lr,
wall budgets, source tokens, EAGLE-3 beside it, warm start) are the flags `add_recipe_args` adds.

`evaluate_heads` loads every `drafter-*` head of a folder with the project's loader and measures its
top-1 per depth on the held-out answers (every 50th, 222 for SmolLM2: the curves' own yardstick),
beside the shipped head's last curve row and the supervised elements of the run and its history.

Moving the target and the heads to and from a remote GPU machine (parts, manifests, staging) is
the script's work, not the package's: scripts/gpu_transfer.py (run by scripts/gpu_train.sh).
Tests: tests/train/test_gpu_run.py (the recipe, and the whole remote run rehearsed on the CPU),
tests/train/test_train_gpu.py (the online pass on CUDA, marked gpu).
"""

from __future__ import annotations

import argparse
import hashlib
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

from peagle_trt.errors import ConfigError
from peagle_trt.train.cli import comma_list

ANSWERS = Path("data/smollm2-135m-instruct/answers.jsonl.gz")
SHIPPED = {"peagle": Path("tests/data/smollm2-heads/peagle"), "eagle3": Path("tests/data/smollm2-heads/eagle3")}
LAYOUTS = {"peagle": "aws", "eagle3": "speculators"}
MASK_TOKEN_ID = 4  # the shipped P-EAGLE head's (scripts/make_smollm2_heads.py)


@dataclass(frozen=True)
class GpuRecipe:
    """The GPU run's knobs (each choice to be kept by its held-out curve)."""
    layers: int = 1  # 1, 2 or 4 (a warm start grows a 1-layer head: added layers start as identity)
    train_embeddings: bool = False  # P-EAGLE: train the embedding table (the head then ships one;
    # a warm head that ships its own keeps training and shipping it: loop.check_frozen_embeddings)
    depths: int = 5  # P-EAGLE parallel depth / EAGLE-3 training-time-test steps
    depth_weights: tuple | None = None  # per-depth loss weights (None: 1.0 each)
    batch: int = 32  # sequences per step (the target's pass is one batched prefill of them)
    lr: float = 5e-4
    warmup: int = 20
    seq_len: int = 2048
    segment_tokens: int = 2048  # one segment per sequence: fewer launches (GPU memory is not short)
    max_context: int = 256
    draft_vocab: int = 8192  # a fresh head's; a warm start keeps its head's
    source_tokens: int = 8_000_000  # teacher-forced Python source of the machine's site-packages
    peagle_wall_s: float = 200.0  # training wall seconds (evaluations excluded), the cosine spans them
    eagle3_wall_s: float = 120.0
    eagle3: bool = True  # EAGLE-3 trained beside it on the same data
    warm_start: bool = True  # from the shipped heads (tests/data/smollm2-heads)
    curriculum: int = 0  # depth 0 alone for N steps (a fresh head: 250, as the CPU recipe)
    eval_every: int = 100
    seed: int = 0

    def check(self) -> None:
        if self.layers not in (1, 2, 4):
            raise ConfigError(f"--layers {self.layers}: the GPU recipe tries 1, 2 or 4")
        if self.peagle_wall_s <= 0 or (self.eagle3 and self.eagle3_wall_s <= 0):
            raise ConfigError("--peagle-wall-s and --eagle3-wall-s must be positive seconds")

    def train_config(self, method: str, target: Path, data: Path, output: Path, device: str,
                     source_roots: tuple = (), init_from: Path | None = None, wall_s: float | None = None,
                     **over):
        """The TrainConfig of one head of this run."""
        from peagle_trt.checkpoint import load_drafter
        from peagle_trt.train.config import TrainConfig

        warm = load_drafter(init_from).config if init_from is not None else None
        # a warm start keeps its head's taps, mask token and tap norms (and its draft vocabulary: loop.py)
        taps = tuple(warm.aux_layer_ids) if warm else None
        mask = (warm.mask_token_id if warm else MASK_TOKEN_ID) if method == "peagle" else None
        cfg = TrainConfig(
            target=target, output=output, method=method, layout=LAYOUTS[method], data=data, depths=self.depths,
            depth_weights=self.depth_weights, segment_tokens=self.segment_tokens, max_context=self.max_context,
            freeze_embeddings=not self.train_embeddings and not (warm and warm.has_embed),
            fc_norm=warm.fc_norm if warm else True, layers=self.layers,
            draft_vocab=self.draft_vocab, taps=taps, mask_token_id=mask,
            steps=1_000_000, batch=self.batch, seq_len=self.seq_len, lr=self.lr, warmup=self.warmup, seed=self.seed,
            device=device, save_dtype="bfloat16", held_out_every=50, eval_every=self.eval_every, eval_len=512,
            curriculum=self.curriculum if method == "peagle" else 0, init_from=init_from, online=True,
            wall_budget_s=wall_s or (self.peagle_wall_s if method == "peagle" else self.eagle3_wall_s),
            source_tokens=self.source_tokens, source_roots=tuple(source_roots), save_every=200, log_every=20,
            force=True)
        return replace(cfg, **over) if over else cfg


def add_recipe_args(ap: argparse.ArgumentParser) -> None:
    d = GpuRecipe()
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--train-embeddings", action="store_true")
    ap.add_argument("--depths", type=int, default=d.depths)
    ap.add_argument("--depth-weights", default=None, help="comma-separated, one per depth, e.g. 1,1,0.8,0.6,0.5")
    ap.add_argument("--batch", type=int, default=d.batch)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--segment-tokens", type=int, default=d.segment_tokens)
    ap.add_argument("--max-context", type=int, default=d.max_context)
    ap.add_argument("--draft-vocab", type=int, default=d.draft_vocab)
    ap.add_argument("--source-tokens", type=int, default=d.source_tokens)
    ap.add_argument("--peagle-wall-s", type=float, default=d.peagle_wall_s)
    ap.add_argument("--eagle3-wall-s", type=float, default=d.eagle3_wall_s)
    ap.add_argument("--no-eagle3", action="store_true")
    ap.add_argument("--no-warm-start", action="store_true", help="fresh heads (then --curriculum 250 is advised)")
    ap.add_argument("--curriculum", type=int, default=d.curriculum)
    ap.add_argument("--eval-every", type=int, default=d.eval_every)
    ap.add_argument("--seed", type=int, default=d.seed)


def recipe_from_args(args) -> GpuRecipe:
    weights = comma_list(args.depth_weights, float, "--depth-weights", "expected numbers, e.g. 1,1,0.8")
    names = {f.name for f in fields(GpuRecipe)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    recipe = GpuRecipe(**{**kw, "depth_weights": weights, "train_embeddings": args.train_embeddings,
                          "eagle3": not args.no_eagle3, "warm_start": not args.no_warm_start})
    recipe.check()
    return recipe


def head_budget(recipe: GpuRecipe, method: str, left: float) -> float | None:
    """Training wall seconds for `method` with `left` seconds of the call to go (None: skip it).
    Each head reserves 60 s + 15% of its budget (set-up: target, data, held-out pass; evaluations;
    packing); P-EAGLE comes first: EAGLE-3 shrinks, then is skipped, before P-EAGLE shrinks."""
    budget = recipe.peagle_wall_s if method == "peagle" else recipe.eagle3_wall_s
    reserve = 60.0 + 0.15 * budget
    later = 90.0 + 1.15 * recipe.eagle3_wall_s if method == "peagle" and recipe.eagle3 else 0.0
    if left >= budget + reserve + later:
        return budget
    if method == "peagle":
        budget = max(left - reserve - later, min(budget, left - reserve - 60.0))
    else:
        budget = left - reserve
    return budget if budget >= 20 else None


def note(msg: str, final: bool = True) -> None:
    import sys

    if final:
        print(f"[gpu-train {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def train_heads(recipe: GpuRecipe, target_dir: Path, data: Path, trained: Path, device: str = "cuda",
                source_roots: tuple = (), heads: dict | None = None, deadline_s: float = 570.0,
                overrides: dict | None = None, t0: float | None = None) -> dict:
    """Train P-EAGLE (then EAGLE-3, when the recipe has it) on `device` into trained/drafter-METHOD,
    each within what is left of `deadline_s` (counted from `t0`, default now); `heads`: method ->
    the head to warm-start from. Returns {method: the train summary, or why it was skipped or failed,
    "total_s": seconds since t0}."""
    from peagle_trt.train.loop import train

    t0 = time.monotonic() if t0 is None else t0
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda but torch sees no CUDA device; pass --device cpu to rehearse")
        # TF32 GEMMs, the target's pass too: `evaluate_heads` re-evaluates the heads in fp32
        torch.backends.cuda.matmul.allow_tf32 = True
    summary: dict = {}
    for method in ["peagle"] + (["eagle3"] if recipe.eagle3 else []):
        left = deadline_s - (time.monotonic() - t0)
        budget = head_budget(recipe, method, left)
        if budget is None:
            note(f"{method}: skipped ({left:.0f} s left in the call)")
            summary[method] = {"skipped": f"{left:.0f} s left"}
            continue
        init = (heads or {}).get(method) if recipe.warm_start else None
        cfg = recipe.train_config(method, target_dir, data, trained / f"drafter-{method}", device, source_roots,
                                  init, wall_s=budget, checkpoint_dir=trained.parent / f"ckpt-{method}",
                                  **(overrides or {}))
        note(f"{method}: training online for {budget:.0f} s of wall time on {device}"
             + (f", warm from {init}" if init else ""))
        try:
            summary[method] = train(cfg, lambda line, final=False: note(f"{method} {line}", final))
        except Exception as exc:  # the other head and the packing still run; the summary says why
            if method == "peagle" and not recipe.eagle3:
                raise
            note(f"{method} failed: {type(exc).__name__}: {exc}")
            summary[method] = {"error": f"{type(exc).__name__}: {exc}"}
    summary["total_s"] = round(time.monotonic() - t0, 1)
    return summary


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def evaluate_heads(root: Path, target: Path, data: Path, repo: Path = Path("."), eval_len: int = 512,
                   held_out_every: int = 50, max_context: int = 256, run: dict | None = None) -> dict:
    """Every `drafter-*` head under `root`: loaded with the project's loader, top-1 per depth on the
    held-out answers (every `held_out_every`th, as the curves'), beside the shipped head's last curve
    row; `run`: the training summary (its steps and throughput join each head's entry)."""
    from peagle_trt.checkpoint import load_drafter, load_target
    from peagle_trt.models.target import TargetModel
    from peagle_trt.tokenizer import TextCodec
    from peagle_trt.train import curve as C
    from peagle_trt.train import data as D
    from peagle_trt.train.config import TrainConfig
    from peagle_trt.train.loop import build_head, head_draft_ids, warm_start

    ckpt, codec, run = load_target(target), TextCodec(target), run or {}
    corpus = D.prompt_corpus(None, codec, data, 0, 0.0, 0, True, note, max_context)
    _, held_idx = C.split(len(corpus.sequences), held_out_every)
    held_corpus = C.subset(corpus, held_idx)
    targets, helds, report = {}, {}, {}
    for head_dir in sorted(Path(root).glob("drafter-*")):
        method = head_dir.name.removeprefix("drafter-")
        hc = load_drafter(head_dir).config  # the project's loader: the check that it is a head
        taps = tuple(hc.aux_layer_ids)
        if taps not in targets:
            targets[taps] = TargetModel.from_tensors(ckpt.config, ckpt.tensors, taps)
        draft_ids = head_draft_ids(head_dir, ckpt.config.vocab_size)
        key = (taps, hashlib.sha256(draft_ids.numpy().tobytes()).hexdigest())  # heads alike share the pass
        if key not in helds:
            helds[key] = C.held_out_features(targets[taps], held_corpus, draft_ids, eval_len)
        held = helds[key]
        depths = int(hc.trained_depth or 5)
        cfg = TrainConfig(target=Path(target), output=head_dir, text=("-",), method=method, layout=LAYOUTS[method],
                          layers=hc.num_layers, intermediate_size=hc.intermediate_size, fc_norm=hc.fc_norm,
                          freeze_embeddings=not hc.has_embed, depths=depths)
        head, _ = build_head(cfg, ckpt, taps, hc.mask_token_id, draft_ids)  # as a warm start builds it
        warm_start(head, head_dir)
        t = time.monotonic()
        top1 = C.evaluate(head, held, hc.mask_token_id, depths)
        entry = {"sha256": _file_sha256(head_dir / "model.safetensors"), "layers": hc.num_layers,
                 "trained_depth": depths, "held_out_answers": len(held.seqs),
                 "held_out_positions": held.supervised, "top1": top1,
                 "chain_accepted_k7": C.chain_acceptance(top1, 7), "eval_s": round(time.monotonic() - t, 1)}
        for k in ("steps", "supervised_tokens", "supervised_tokens_per_s", "train_wall_s", "held_out_top1"):
            if k in run.get(method, {}):
                entry[f"gpu_{k}"] = run[method][k]
        shipped = C.read_rows(Path(repo) / SHIPPED.get(method, Path("-")))
        if shipped:
            entry["shipped_last_row"] = {"top1": shipped[-1]["top1"],
                                         "chain_accepted_k7": shipped[-1].get("chain_accepted_k7")}
        entry.update(run_history(head_dir))
        report[method] = entry
        note(f"{method}: loads; held-out top-1 " + " ".join(f"{a:.3f}" for a in top1)
             + f", chain proxy {entry['chain_accepted_k7']}")
    return report


def run_history(head_dir: Path) -> dict:
    """The head's curve as one history (the warm start's runs, then this run's, `run` numbered on):
    the supervised elements this run added, and those of the runs before it."""
    from peagle_trt.train import curve as C

    rows = C.read_rows(head_dir)
    if not rows:
        return {}
    first = next(r for r in rows if r.get("run", 0) == rows[-1].get("run", 0))
    out = {"run_supervised_elements": rows[-1]["supervised_seen"] - first["supervised_seen"],
           "earlier_runs_supervised_elements": first["supervised_seen"]}
    if first["supervised_seen"]:
        out["run_over_earlier_runs"] = round(out["run_supervised_elements"] / first["supervised_seen"], 2)
    return out
