"""The training loop: `train(TrainConfig)` (the stage's entry point) as `setup` (target, data,
head, features, optimiser, resume), `step` (one optimiser step), `evaluate` (a held-out curve row),
`save_checkpoint` and `finish` (the head, its curve and the summary); `run` strings them together.

Per step: sample `batch` sequences, run the frozen target over them (taps + distribution over the
draft vocabulary: from the feature cache, or `online` in one batched pass), COD-sample the flat
multi-depth elements, then forward+backward each sequence partition (segment; its context of
earlier positions recomputed in backward, and the target's distribution made for its rows only,
so memory stays flat in the sequence's length) with the loss divided by the batch's supervised element
count (each depth's KL weighted by `depth_weights`
where given), clip, AdamW step. Checkpoints hold the head, the optimiser and the data/COD
generator state, so a resumed run continues with exactly the batches an uninterrupted run would
have drawn. The summary reports supervised tokens (depth-0 positions) per second of training wall time.
Tests: tests/train/test_train_run.py, tests/train/test_train_curve.py, tests/train/test_gpu_run.py.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from peagle_trt.architecture import DrafterConfig
from peagle_trt.checkpoint import load_drafter, load_target
from peagle_trt.errors import CheckpointError, ConfigError
from peagle_trt.models.drafter import DrafterModel
from peagle_trt.models.target import TargetModel
from peagle_trt.tokenizer import TextCodec
from peagle_trt.train import curve as C
from peagle_trt.train import data as D
from peagle_trt.train.cod import cod_sample, partition
from peagle_trt.train.config import TrainConfig
from peagle_trt.train.forward import TrainHead, segment_loss
from peagle_trt.train.save import write_head

MASK_TOKEN_NAMES = ("<|reserved_mask|>", "<|mask|>", "<mask>", "[MASK]")


def find_mask_token(codec: TextCodec, explicit: int | None, vocab_size: int) -> int:
    if explicit is not None:
        if not 0 <= explicit < vocab_size:
            raise ConfigError(f"--mask-token-id {explicit} is outside the vocabulary [0, {vocab_size})")
        return explicit
    vocab = codec.tok.get_vocab()
    for name in MASK_TOKEN_NAMES:
        if name in vocab:
            return int(vocab[name])
    raise ConfigError(f"no reserved mask token ({', '.join(MASK_TOKEN_NAMES)}) in the target's tokenizer; "
                      "pass --mask-token-id with an id the target never generates")


def build_head(cfg, target_ckpt, taps, mask_id, draft_ids) -> tuple[TrainHead, DrafterConfig]:
    t = target_ckpt.config
    config = DrafterConfig(
        layout=cfg.layout, hidden_size=t.hidden_size, num_layers=cfg.layers, num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
        intermediate_size=cfg.intermediate_size or t.intermediate_size, rms_norm_eps=t.rms_norm_eps,
        rope=t.rope, vocab_size=t.vocab_size, draft_vocab_size=len(draft_ids), target_hidden_size=t.hidden_size,
        aux_layer_ids=tuple(taps), mask_token_id=mask_id if cfg.method == "peagle" else None,
        has_mask_hidden=cfg.method == "peagle", trained_depth=cfg.depths, fc_norm=cfg.fc_norm)
    torch.manual_seed(cfg.seed)
    model = DrafterModel(config)
    with torch.no_grad():  # embeddings and lm_head rows start from the target's (as the P-EAGLE paper initialises them)
        model.embed_tokens.weight.copy_(target_ckpt.tensors["embed_tokens.weight"].float())
        model.lm_head.weight.copy_(target_ckpt.tensors["lm_head.weight"].float()[draft_ids])
        model.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
    if cfg.init_layer == "target":
        _layer_from_target(model, target_ckpt)
    model.lm_head.weight.requires_grad_(False)  # frozen, as in speculators
    # P-EAGLE trains its embeddings unless frozen (then the head ships none and uses the target's)
    model.embed_tokens.weight.requires_grad_(cfg.method == "peagle" and not cfg.freeze_embeddings)
    return TrainHead(model, cfg.method == "peagle"), config


@torch.no_grad()
def _layer_from_target(model: DrafterModel, target_ckpt) -> None:
    """--init-layer target: the drafter's layer 0 starts as the target's last layer on its hidden half
    (q/k/v columns of the fused hidden input, o_proj, MLP, norms); the embedding half keeps its
    random init. Needs the target's MLP width and head shapes."""
    last = target_ckpt.config.num_layers - 1
    fusion, h = model.layers[0], model.config.hidden_size

    def src(name: str) -> torch.Tensor:
        return target_ckpt.tensors[f"layers.{last}.{name}"].float()

    pairs = [(fusion.self_attn.o_proj.weight, "self_attn.o_proj.weight"),
             (fusion.hidden_norm.weight, "input_layernorm.weight"),
             (fusion.post_attention_layernorm.weight, "post_attention_layernorm.weight"),
             *[(getattr(fusion.mlp, n).weight, f"mlp.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj")]]
    pairs += [(getattr(fusion.self_attn, n).weight[:, h:], f"self_attn.{n}.weight")
              for n in ("q_proj", "k_proj", "v_proj")]
    for dst, name in pairs:
        if dst.shape != src(name).shape:
            raise ConfigError(f"--init-layer target: the drafter's {name} is {tuple(dst.shape)}, the target's "
                              f"{tuple(src(name).shape)} (keep the target's --intermediate-size)")
        dst.copy_(src(name))


def _identity(cfg) -> dict:
    """The config fields a checkpoint must agree with to be resumed."""
    keep = ("method", "depths", "down_sample_ratio", "down_sample_ratio_min", "layers", "intermediate_size",
            "draft_vocab", "taps", "steps", "batch", "seq_len", "lr", "seed", "segments", "segment_tokens",
            "max_context", "freeze_embeddings", "fc_norm", "held_out_every", "curriculum", "init_layer",
            "train_sequences", "train_from")
    # fields added later count only when set, so checkpoints written before them still resume
    later = {"depth_weights": None, "online": False, "wall_budget_s": None, "source_tokens": 0}
    keep += tuple(k for k, default in later.items() if getattr(cfg, k) != default)
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items() if k in keep}


def _lr(cfg, step: int, cpu_s: float, wall_s: float = 0.0) -> float:
    """Warm-up, then cosine decay to 0.1 lr over the run: over its steps, or over its CPU (or wall) budget."""
    warmup = cfg.warmup if cfg.warmup is not None else max(1, cfg.steps // 20)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.cpu_budget_s:
        frac = cpu_s / cfg.cpu_budget_s
    elif cfg.wall_budget_s:
        frac = wall_s / cfg.wall_budget_s
    else:
        frac = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


@dataclass
class Session:
    """The state of one training run between `setup` and `finish` (mutable; the settings are `cfg`)."""
    cfg: TrainConfig
    progress: Callable
    t_start: float
    target: TargetModel
    taps: tuple
    mask_id: int | None
    corpus: D.Corpus
    draft_ids: torch.Tensor
    head: TrainHead
    config: DrafterConfig
    features: D.FeatureCache | D.OnlineFeatures
    held: C.HeldOut | None
    params: list
    opt: torch.optim.Optimizer
    gen: torch.Generator
    ckpt_file: Path | None
    start: int = 0  # the step this process began at (a resumed run: the checkpoint's)
    step: int = 0
    cpu_s: float = 0.0  # training process time (evaluations excluded)
    wall_s: float = 0.0  # training wall time (evaluations excluded)
    curve: list = field(default_factory=list)
    history: list = field(default_factory=list)  # per-step loss
    acc: list = field(default_factory=list)  # the last step's per-depth top-1 on its batch
    tokens_seen: int = 0  # supervised elements (every depth), over the whole history
    supervised_tokens: int = 0  # supervised positions (depth 0) trained on by this process
    t_loop: float = 0.0
    held_text: C.HeldOut | None = None  # --held-out-text-list: long held-out text pieces (a second curve)

    @property
    def done(self) -> bool:
        cfg = self.cfg
        return (self.step >= cfg.steps or bool(cfg.cpu_budget_s and self.cpu_s >= cfg.cpu_budget_s)
                or bool(cfg.wall_budget_s and self.wall_s >= cfg.wall_budget_s))


def load_corpus(cfg: TrainConfig, target, codec, progress) -> tuple[D.Corpus, D.Corpus | None]:
    """The training corpus and the held-out one (None without --data): answers, text, source."""
    held_corpus = None
    corpus = None
    if cfg.data is not None:
        corpus = D.prompt_corpus(target, codec, cfg.data, cfg.regen_max_tokens, cfg.regen_temperature,
                                 cfg.seed, cfg.chat_template, progress, cfg.max_context)
        train_idx, held_idx = C.split(len(corpus.sequences), cfg.held_out_every)
        train_idx = train_idx[cfg.train_from:][:cfg.train_sequences]  # None: all
        if not train_idx:
            raise ConfigError(f"no training sequences left: the data has {len(corpus.sequences)}, {len(held_idx)} "
                              f"held out, --train-from {cfg.train_from} skipped the rest")
        corpus, held_corpus = C.subset(corpus, train_idx), C.subset(corpus, held_idx)
    eos = codec.eos_ids[0] if codec.eos_ids else 0
    piece = None if cfg.data is None else text_pieces(cfg)
    if cfg.text:  # alone: windows of one stream; beside --data: pieces, extra training sequences
        text = D.text_corpus(codec.tok, list(cfg.text), eos, piece)
        if cfg.data is not None:
            size = "/".join(map(str, sorted(set(piece), reverse=True))) if len(piece) > 1 else piece[0]
            progress(f"training on {len(corpus.sequences)} answers and {len(text.sequences)} text pieces "
                     f"of {size} tokens", final=True)
        corpus = text if corpus is None else D.joined(corpus, text)
    if cfg.source_tokens:  # beside --data (TrainConfig.check): this machine's Python source, teacher-forced
        from peagle_trt.train.source import source_corpus

        src = source_corpus(codec.tok, cfg.source_roots, cfg.source_tokens, piece[0], eos, progress)
        progress(f"training on {len(corpus.sequences)} sequences and {len(src.sequences)} pieces of this "
                 f"machine's Python source ({len(src.sequences) * piece[0]} tokens)", final=True)
        corpus = D.joined(corpus, src)
    return corpus, held_corpus


def text_pieces(cfg: TrainConfig) -> tuple:
    """The sizes text beside --data is cut into (in turn), each at most --seq-len."""
    return tuple(min(cfg.seq_len, n) for n in (cfg.text_piece or (D.TEXT_PIECE,)))


def kept_passes(features):
    """The held-out text's target passes through a feature cache file (a resumed run reads them), or None."""
    return features.passes if isinstance(features, D.FeatureCache) and features.path is not None else None


def setup(cfg: TrainConfig, progress) -> Session:
    """Target, data, head (fresh or warm), target features, held-out set, optimiser; resumed from
    cfg.checkpoint_dir's state when one is there."""
    t_start = time.perf_counter()
    dev = torch.device(cfg.device)
    target_ckpt = load_target(cfg.target)
    tc = target_ckpt.config
    taps = tuple(cfg.taps) if cfg.taps else tuple(tc.default_taps)
    if len(taps) != 3 or any(not 0 <= x < tc.num_layers for x in taps):
        raise ConfigError(f"--taps {list(taps)}: expected 3 layer ids in [0, {tc.num_layers - 1}]")
    target = TargetModel.from_tensors(tc, target_ckpt.tensors, taps, dev, torch.float32,
                                      f"target {cfg.target}")
    codec = TextCodec(cfg.target)
    mask_id = find_mask_token(codec, cfg.mask_token_id, tc.vocab_size) if cfg.method == "peagle" else None
    corpus, held_corpus = load_corpus(cfg, target, codec, progress)
    if cfg.init_from is not None:  # a warm start keeps its head's draft vocabulary, whatever the data
        draft_ids = head_draft_ids(cfg.init_from, tc.vocab_size)
    else:
        draft_ids = D.draft_vocabulary(corpus, tc.vocab_size, cfg.draft_vocab or tc.vocab_size)
    head, config = build_head(cfg, target_ckpt, taps, mask_id, draft_ids)
    if cfg.init_from is not None:
        check_frozen_embeddings(cfg, target_ckpt)
        warm_start(head, cfg.init_from)
        progress(f"warm start from the head in {cfg.init_from}", final=True)
    if cfg.online:
        features = D.OnlineFeatures(target, draft_ids)
    else:
        features = D.FeatureCache(target, draft_ids, cfg.feature_cache, D.target_fingerprint(cfg.target))
        if features.loaded:
            progress(f"target features of {features.loaded} sequences read from {cfg.feature_cache}", final=True)
        if cfg.feature_cache:
            features.fill(corpus, cfg.seq_len, progress)
    held = None
    if cfg.eval_every and held_corpus is not None and held_corpus.sequences:
        held = C.held_out_features(target, held_corpus, draft_ids, cfg.eval_len)
        progress(f"held out: {len(held.seqs)} sequences, {held.supervised} supervised positions "
                 f"(every {cfg.held_out_every}th of the data)", final=True)
    held_text = None
    if cfg.eval_every and cfg.held_out_text:
        eos = codec.eos_ids[0] if codec.eos_ids else 0
        text = D.text_corpus(codec.tok, list(cfg.held_out_text), eos, text_pieces(cfg))
        held_text = C.held_out_features(target, text, draft_ids, max(text_pieces(cfg)), kept_passes(features))
        progress(f"held out text: {len(held_text.seqs)} pieces, {held_text.supervised} positions", final=True)
        features.save()  # their passes too (a resumed run reads them)
    head.to(dev)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    s = Session(cfg, progress, t_start, target, taps, mask_id, corpus, draft_ids, head, config, features, held,
                params, opt, gen, cfg.checkpoint_dir / "state.pt" if cfg.checkpoint_dir else None)
    s.held_text = held_text
    resume(s)
    return s


def resume(s: Session) -> None:
    """Continue from the checkpoint in cfg.checkpoint_dir, if there is one (same identity only)."""
    if s.ckpt_file is None or not s.ckpt_file.is_file():
        return
    state = torch.load(s.ckpt_file, map_location=torch.device(s.cfg.device), weights_only=True)
    if state["identity"] != _identity(s.cfg):
        raise CheckpointError(f"{s.ckpt_file} was written by a different training config "
                              f"({state['identity']}); use another --checkpoint-dir or the same flags")
    s.head.load_state_dict(state["head"])
    s.opt.load_state_dict(state["optimizer"])
    s.gen.set_state(state["generator"])
    s.start = s.step = state["step"]
    s.cpu_s, s.curve = state.get("train_cpu_s", 0.0), state.get("curve", [])
    s.wall_s = state.get("train_wall_s", 0.0)
    s.tokens_seen = s.curve[-1]["supervised_seen"] if s.curve else 0
    s.progress(f"resumed from {s.ckpt_file} at step {s.start}", final=True)


def evaluate(s: Session, loss: float | None) -> None:
    """One curve row: the held-out per-depth top-1 now."""
    top1 = C.evaluate(s.head, s.held, s.mask_id, s.cfg.depths)
    row = {"step": s.step, "train_cpu_s": round(s.cpu_s, 3), "wall_s": round(time.perf_counter() - s.t_start, 1),
           "supervised_seen": s.tokens_seen, "loss": None if loss is None else round(loss, 4), "top1": top1,
           "chain_accepted_k7": C.chain_acceptance(top1, 7)}
    if s.held_text is not None:
        by_pos = C.evaluate_by_position(s.head, s.held_text, s.mask_id, s.cfg.depths, segment_tokens=2048)
        row.update(top1_text=by_pos.pop("all"), top1_text_by_position=by_pos)
        s.progress("held-out text top-1: " + " ".join(f"{a:.3f}" for a in row["top1_text"]) + " | position 1 by "
                   "context: " + " ".join(f"{k}: {v[0]:.3f}" for k, v in by_pos.items()), final=True)
    if s.cfg.device != "cpu":  # a GPU run's rows say so (its train_cpu_s is the host's process time)
        row.update(device=s.cfg.device, train_wall_s=round(s.wall_s, 1))
    s.curve.append(row)
    s.progress(f"held-out top-1 at step {s.step} ({s.cpu_s / 60:.1f} CPU min): "
               + " ".join(f"{a:.3f}" for a in top1), final=True)


def step(s: Session) -> None:
    """One optimiser step (learning rate, batch, clip, AdamW) and its progress line."""
    cfg = s.cfg
    for group in s.opt.param_groups:
        group["lr"] = _lr(cfg, s.step, s.cpu_s, s.wall_s)
    c0, w0 = time.process_time(), time.perf_counter()
    depths = 1 if s.step < cfg.curriculum else cfg.depths
    loss, stats, tokens, supervised = train_step(s.head, s.features, s.corpus, cfg, s.gen, s.mask_id, depths)
    torch.nn.utils.clip_grad_norm_(s.params, 1.0)
    s.opt.step()
    s.opt.zero_grad(set_to_none=True)
    s.cpu_s += time.process_time() - c0
    s.wall_s += time.perf_counter() - w0
    s.tokens_seen += supervised
    s.supervised_tokens += stats.get(0, [0, 0])[0]
    s.step += 1
    s.history.append(loss)
    s.acc = [stats[d][1] / stats[d][0] if d in stats else 0.0 for d in range(cfg.depths)]
    rate = (s.step - s.start) * tokens / (time.perf_counter() - s.t_loop)
    line = (f"step {s.step}/{cfg.steps} loss {loss:.4f} acc " + " ".join(f"{a:.2f}" for a in s.acc)
            + f" | {rate:.0f} tok/s, {s.supervised_tokens / max(s.wall_s, 1e-9):.0f} supervised/s")
    s.progress(line, final=s.step % cfg.log_every == 0 or s.step == cfg.steps)


def save_checkpoint(s: Session) -> None:
    if s.ckpt_file is not None:
        _save(s.ckpt_file, s.cfg, s.head, s.opt, s.gen, s.step, s.cpu_s, s.curve, s.wall_s)


def finish(s: Session) -> dict:
    """The last evaluation and checkpoint, the head (and its curve, one history with its warm
    start's) in cfg.output; returns the run's summary."""
    cfg, history = s.cfg, s.history
    if s.held is not None and (not s.curve or s.curve[-1]["step"] != s.step):
        evaluate(s, sum(history[-10:]) / max(1, len(history[-10:])) if history else None)
    save_checkpoint(s)
    s.features.save()
    title = (f"{cfg.method} head, depth {cfg.depths}, lr {cfg.lr}, batch {cfg.batch}"
             + (f", depth 0 only for {cfg.curriculum} steps" if cfg.curriculum else ""))
    history_rows = C.continued(C.read_rows(cfg.init_from) if cfg.init_from else [], s.curve)  # one history
    write_head(cfg.output, s.head, s.config, s.draft_ids, cfg,
               curve=(history_rows, title) if s.held is not None else None)
    return {"output": str(cfg.output), "method": cfg.method, "layout": cfg.layout, "steps": s.step,
            "resumed_at": s.start, "final_loss": round(history[-1], 5) if history else None,
            "mean_loss_last10": round(sum(history[-10:]) / max(1, len(history[-10:])), 5) if history else None,
            "accuracy_per_depth": [round(a, 4) for a in s.acc] if history else None,
            "held_out_top1": s.curve[-1]["top1"] if s.curve else None,
            "held_out_chain_accepted_k7": s.curve[-1]["chain_accepted_k7"] if s.curve else None,
            "draft_vocab": len(s.draft_ids), "taps": list(s.taps), "mask_token_id": s.mask_id,
            "train_sequences": len(s.corpus.sequences), "held_out_sequences": len(s.held.seqs) if s.held else 0,
            "params_trained": sum(p.numel() for p in s.params), "train_cpu_s": round(s.cpu_s, 3),
            "train_wall_s": round(s.wall_s, 1), "supervised_tokens": s.supervised_tokens,
            "supervised_tokens_per_s": round(s.supervised_tokens / max(s.wall_s, 1e-9), 1),
            "device": cfg.device, "online": cfg.online, "train_s": round(time.perf_counter() - s.t_start, 1)}


def run(cfg: TrainConfig, progress) -> dict:
    """setup, then steps with a held-out evaluation every cfg.eval_every and a checkpoint every
    cfg.save_every, then finish."""
    s = setup(cfg, progress)
    if s.held is not None and not s.curve:
        evaluate(s, None)  # before training: no loss yet
    s.t_loop = time.perf_counter()
    while not s.done:
        step(s)
        if s.held is not None and s.step % cfg.eval_every == 0:
            recent = s.history[-cfg.eval_every:]
            evaluate(s, sum(recent) / len(recent))
        if s.step % cfg.save_every == 0 or s.step == cfg.steps:
            save_checkpoint(s)
    return finish(s)


def check_frozen_embeddings(cfg: TrainConfig, target_ckpt) -> None:
    """--freeze-embeddings saves no table (the loader then uses the target's): a warm start from a
    head that ships embeddings of its own would train on them and be served with the target's."""
    if not cfg.freeze_embeddings:
        return
    shipped = load_drafter(cfg.init_from).tensors.get("embed_tokens.weight")
    if shipped is None:
        return
    own = target_ckpt.tensors["embed_tokens.weight"].float()
    if shipped.shape != own.shape or (shipped.float() - own).abs().max() > 1e-2 * own.abs().max():
        raise ConfigError(f"--init-from {cfg.init_from} ships embeddings of its own (trained), and "
                          "--freeze-embeddings would save the head without them (served with the target's); "
                          "drop --freeze-embeddings to keep training and shipping them")


def head_draft_ids(path, vocab_size: int) -> torch.Tensor:
    """The draft vocabulary [V_d] (target ids, sorted) of a trained head."""
    tensors = load_drafter(path).tensors
    if "d2t" not in tensors:
        return torch.arange(vocab_size)
    d2t = tensors["d2t"].long()
    return torch.arange(len(d2t)) + d2t


def warm_start(head: TrainHead, path) -> None:
    """Load a trained head's weights (any layout `load_drafter` reads) into `head`, built with that
    head's draft vocabulary (`head_draft_ids`) and the same shapes: a later run continues from a
    shipped head without its optimiser state. A head with more layers than the loaded one grows:
    its extra layers keep their random init with o_proj and down_proj zeroed, so each adds nothing
    to the residual stream and the grown head drafts exactly as the loaded one until trained."""
    tensors, state = load_drafter(path).tensors, head.model.state_dict()
    loaded_layers = 1 + max(int(n.split(".")[1]) for n in tensors if n.startswith("layers."))
    if loaded_layers > head.model.config.num_layers:
        raise CheckpointError(f"--init-from {path}: the head has {loaded_layers} layers, this run's "
                              f"{head.model.config.num_layers}; pass --layers {loaded_layers} or more")
    new = {}
    for name, value in state.items():
        if name in tensors and name != "d2t":
            if tensors[name].shape != value.shape:
                raise CheckpointError(f"--init-from {path}: {name} has shape {tuple(tensors[name].shape)}, "
                                      f"this run's head {tuple(value.shape)}")
            new[name] = tensors[name].to(value.dtype)
        elif name in ("embed_tokens.weight", "d2t") or (name == "mask_hidden" and not head.parallel):
            # the target's embeddings (frozen-embedding heads ship none); d2t: the same head's; a
            # sequential head's mask_hidden: an unused buffer its layout does not ship
            new[name] = value
        elif name.startswith("layers.") and int(name.split(".")[1]) >= loaded_layers:  # a grown layer
            zero = name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))
            new[name] = torch.zeros_like(value) if zero else value
        else:
            raise CheckpointError(f"--init-from {path}: {name} is missing (a head of another shape: the same "
                                  "--intermediate-size as the head, and --layers at least its own)")
    head.model.load_state_dict(new)
    if head.parallel:
        if "mask_hidden" not in tensors:
            raise CheckpointError(f"--init-from {path}: no mask_hidden; not a P-EAGLE head")
        with torch.no_grad():
            head.mask_hidden.copy_(tensors["mask_hidden"].float().reshape(head.mask_hidden.shape))


def train_step(head, cache, corpus, cfg, gen, mask_id, depths: int) -> tuple[float, dict, int, int]:
    """Forward+backward over one batch (gradients accumulated in the head), chains up to `depths`.
    -> (loss, stats, tokens, supervised elements)."""
    batch = D.sample_batch(corpus, cfg.batch, cfg.seq_len, gen)
    feats = cache.batch(batch)
    elements = [cod_sample(f.loss_mask.cpu(), depths, cfg.down_sample_ratio, cfg.down_sample_ratio_min, gen)
                for f in feats]
    normaliser = sum(int(f.loss_mask.cpu()[el.position].sum()) for f, el in zip(feats, elements))
    if normaliser == 0:
        raise ConfigError("no supervised token in the batch: the sequences have no response tokens "
                          "(raise --regen-max-tokens or --seq-len)")
    total, stats = 0.0, {}
    weights = torch.tensor(cfg.depth_weights, dtype=torch.float32) if cfg.depth_weights else None
    for f, el in zip(feats, elements):
        segments = max(cfg.segments, -(-len(f.tokens) // cfg.segment_tokens)) if cfg.segment_tokens else cfg.segments
        for owned in partition(el, len(f.tokens), segments):
            if owned.numel() == 0:
                continue
            # partitioned: each segment's context (depth 0 from position 0) runs in checkpointed blocks
            loss = segment_loss(head, f, el.to(f.tokens.device), owned.to(f.tokens.device), mask_id,
                                normaliser, stats, weights,
                                recompute=-(-len(f.tokens) // segments) if segments > 1 else 0)
            loss.backward()
            total += float(loss.detach())
    return total, stats, sum(len(ids) for _, ids, _ in batch), normaliser


def _save(path, cfg, head, opt, gen, step: int, cpu_s: float, curve: list, wall_s: float = 0.0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"identity": _identity(cfg), "head": head.state_dict(), "optimizer": opt.state_dict(),
                "generator": gen.get_state(), "step": step, "train_cpu_s": cpu_s, "train_wall_s": wall_s,
                "curve": curve}, tmp)
    tmp.replace(path)


def train(cfg: TrainConfig, progress=None) -> dict:
    """Train and write the head to `cfg.output`; returns a summary (loss, per-depth accuracy, times)."""
    cfg.check()
    if cfg.output.exists() and any(cfg.output.iterdir()) and not cfg.force:
        raise ConfigError(f"{cfg.output} exists and is not empty; pass --force to replace it")
    return run(cfg, progress or _stderr_progress())


def _stderr_progress():
    start = time.perf_counter()

    def show(line: str, final: bool = False) -> None:
        stamp = f"[train {time.perf_counter() - start:6.0f}s] "
        # in-place progress line; `final` lines are kept (newline)
        print("\r" + stamp + line, end="\n" if final else "", file=sys.stderr, flush=True)
    return show
