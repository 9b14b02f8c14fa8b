"""The learning curve of a training run: per-depth top-1 agreement with the target's greedy token on a
fixed held-out split, against the CPU seconds the run has spent training (the yardstick for a recipe).

    held = held_out_features(target, corpus, idx, draft_ids, eval_len)   # once, at start
    row = evaluate(head, held, mask_id, depths)                          # every --eval-every steps
    write_curve(out_dir, rows)                                           # curve.jsonl + curve.png

The split: sequence i of the data is held out iff i % every == every - 1 (`split`), the same for
every seed and recipe, so two runs' curves are comparable. Each held-out sequence is cut to its
first `eval_len` tokens. Evaluation runs every chain (anchor, 0..depths-1) of the supervised
positions (no COD sub-sampling) with the inference mask, and counts a hit where the drafter's argmax,
mapped to a target id, is the target's argmax over its whole vocabulary (a token outside the draft
vocabulary is a miss, as at inference). Depth d's agreement is the rate at position d+1 of a draft
given a correct prefix: what acceptance at that position would be if every earlier draft was right.
Tests: tests/train/test_train_curve.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from peagle_trt.train.cod import cod_sample, partition
from peagle_trt.train.data import Corpus, features, target_pass
from peagle_trt.train.forward import segment_forward


def split(n: int, every: int | None) -> tuple[list[int], list[int]]:
    """Indices of the training and held-out sequences among n (every: None or 0 -> nothing held out)."""
    if not every:
        return list(range(n)), []
    held = [i for i in range(n) if i % every == every - 1]
    return [i for i in range(n) if i % every != every - 1], held


def subset(corpus: Corpus, idx: list[int]) -> Corpus:
    return Corpus([corpus.sequences[i] for i in idx], [corpus.masks[i] for i in idx], corpus.windowed)


@dataclass(frozen=True)
class HeldOut:
    seqs: list  # list[train.forward.SeqFeatures]
    greedy: list  # list[torch.Tensor [N]]: the target's argmax (whole vocabulary) at each drafter position

    @property
    def supervised(self) -> int:
        return sum(int(f.loss_mask.sum()) for f in self.seqs)


@torch.no_grad()
def held_out_features(target, corpus: Corpus, draft_ids: torch.Tensor, eval_len: int, passes=None) -> HeldOut:
    """`passes` (optional, e.g. FeatureCache.passes): ids -> the target's (normed, taps), kept across runs."""
    seqs, greedy = [], []
    for ids, sup in zip(corpus.sequences, corpus.masks):
        ids, sup = ids[:eval_len], sup[:eval_len]
        normed, aux = (passes or (lambda x: target_pass(target, x)))(ids)
        normed, aux = normed.float(), aux.float()
        seqs.append(features(target, ids, sup, normed, aux, draft_ids))
        greedy.append(target.head_logits(normed[1:]).argmax(-1).cpu())  # [N]: the token after position i's
    return HeldOut(seqs, greedy)


@torch.no_grad()
def evaluate(head, held: HeldOut, mask_id: int | None, depths: int, segment_tokens: int = 512) -> list[float]:
    """Per-depth top-1 agreement [depths] of `head` on the held-out sequences."""
    return evaluate_by_position(head, held, mask_id, depths, segment_tokens, width=None)["all"]


@torch.no_grad()
def evaluate_by_position(head, held: HeldOut, mask_id: int | None, depths: int, segment_tokens: int = 512,
                         width: int | None = 2048) -> dict:
    """Per-depth top-1 agreement of `head` on the held-out sequences, in all ("all") and (`width`)
    per span of `width` anchor positions ("0-2047", "2048-4095", ...): agreement against context length."""
    was_training = head.training
    head.eval()
    spans = 1 + max(len(f.tokens) for f in held.seqs) // width if width else 1
    hits, counts = torch.zeros(spans, depths), torch.zeros(spans, depths)
    gen = torch.Generator().manual_seed(0)  # ratio 1: every chain, the generator only orders nothing
    for f, greedy in zip(held.seqs, held.greedy):
        el = cod_sample(f.loss_mask.cpu(), depths, 1.0, 1.0, gen)
        for owned in partition(el, len(f.tokens), max(1, -(-len(f.tokens) // segment_tokens))):
            if owned.numel() == 0:
                continue
            dev = f.tokens.device  # the elements go where the features are (as train_step's)
            sub, x, charged = segment_forward(head, f, el.to(dev), owned.to(dev), mask_id)
            sup = charged & f.loss_mask[sub.position]
            if not bool(sup.any()):
                continue
            drafted = head.model.to_target_ids(head.model.logits(x[sup]).argmax(-1))
            ok = (drafted.cpu() == greedy[sub.position[sup].cpu()]).float()
            cell = sub.depth[sup].cpu() + depths * (sub.anchor[sup].cpu() // width if width else 0)
            counts += torch.bincount(cell, minlength=spans * depths).float().view(spans, depths)
            hits += torch.bincount(cell, weights=ok, minlength=spans * depths).view(spans, depths)
    head.train(was_training)

    def rates(h: torch.Tensor, c: torch.Tensor) -> list[float]:
        return [round(float(a / b), 4) if b else 0.0 for a, b in zip(h, c)]
    out = {"all": rates(hits.sum(0), counts.sum(0))}
    if width:
        out.update({f"{i * width}-{(i + 1) * width - 1}": rates(hits[i], counts[i])
                    for i in range(spans) if counts[i].sum()})
    return out


def chain_acceptance(top1: list[float], k: int) -> float:
    """Expected accepted drafts of a K-chain if position d+1 is accepted at rate top1[d] given a
    correct prefix (the held-out proxy of acceptance length - 1; an estimate, not a measurement)."""
    total, run = 0.0, 1.0
    for a in top1[:k]:
        run *= a
        total += run
    return round(total, 4)


def continued(earlier: list[dict], rows: list[dict]) -> list[dict]:
    """The curve of a warm-started head as one history: the earlier head's curve (its curve.jsonl),
    then this run's rows with steps, CPU seconds and supervised elements counted on from the earlier
    run's end and `run` numbered on (this run's step-0 row, the warm head's own evaluation, stays: it
    shows what the warm start kept)."""
    if not earlier:
        return rows
    last, run = earlier[-1], earlier[-1].get("run", 0) + 1
    shift = {"step": last["step"], "train_cpu_s": last["train_cpu_s"], "supervised_seen": last["supervised_seen"]}
    return earlier + [{**r, **{k: round(r[k] + v, 3) if k == "train_cpu_s" else r[k] + v for k, v in shift.items()},
                       "run": run} for r in rows]


def read_rows(head_dir: Path) -> list[dict]:
    """The rows of the curve.jsonl beside a head ([] when it has none)."""
    path = Path(head_dir) / "curve.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def write_curve(out_dir: Path, rows: list[dict], title: str) -> None:
    """curve.jsonl (one row per evaluation) and curve.png (per-depth top-1 against CPU hours)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "curve.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    hours = [r["train_cpu_s"] / 3600 for r in rows]
    depths = len(rows[-1]["top1"])
    for d in range(min(depths, 6)):
        ax.plot(hours, [r["top1"][d] if d < len(r["top1"]) else None for r in rows], marker=".",
                label=f"position {d + 1}")
    for a, b in zip(rows, rows[1:]):  # a warm start (`continued`): where the next run began
        if b.get("run", 0) != a.get("run", 0):
            ax.axvline(b["train_cpu_s"] / 3600, color="grey", ls=":", lw=1)
    ax.set_xlabel("training CPU hours (process time, all threads; dotted: a warm start)")
    ax.set_ylabel("held-out top-1 agreement with the target")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out_dir / "curve.png", dpi=110)
    plt.close(fig)

