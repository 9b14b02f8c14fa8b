"""The learning curve (peagle_trt/train/curve.py): the fixed held-out split, the held-out evaluation against the
inference model, curve files beside the head, CPU-budgeted runs and a warm start from a head."""

from __future__ import annotations

import json

import pytest
import torch

from peagle_trt.checkpoint import load_target
from peagle_trt.errors import CheckpointError, ConfigError
from peagle_trt.models.target import TargetModel
from peagle_trt.train import TrainConfig, train
from peagle_trt.train import curve as C
from peagle_trt.train.data import Corpus
from peagle_trt.train.loop import build_head


def test_split_is_fixed_and_disjoint():
    train_idx, held = C.split(10, 4)
    assert held == [3, 7] and sorted(train_idx + held) == list(range(10))
    assert C.split(5, 0) == ([0, 1, 2, 3, 4], []) and C.split(5, None) == ([0, 1, 2, 3, 4], [])


def test_chain_acceptance_is_the_product_sum():
    assert C.chain_acceptance([0.5, 0.5, 0.5], 2) == 0.75
    assert C.chain_acceptance([1.0, 0.0, 1.0], 3) == 1.0


def test_held_out_agreement_matches_the_inference_model(tiny):
    """Depth 0's agreement counts exactly the positions where the inference model's causal pass
    (real rows, taps) drafts the target's whole-vocabulary argmax."""
    ckpt = load_target(tiny["llama"])
    taps = (1, 3, 5)
    target = TargetModel.from_tensors(ckpt.config, ckpt.tensors, taps)
    torch.manual_seed(0)
    ids = torch.randint(0, ckpt.config.vocab_size, (30,))
    sup = torch.arange(30) >= 6
    draft_ids = torch.arange(0, ckpt.config.vocab_size, 2)
    held = C.held_out_features(target, Corpus([ids], [sup], False), draft_ids, eval_len=64)
    cfg = TrainConfig(target=ckpt.path, output=ckpt.path, text=("x",))
    head, _ = build_head(cfg, ckpt, taps, 3, draft_ids)
    top1 = C.evaluate(head, held, 3, depths=3, segment_tokens=8)
    f, greedy = held.seqs[0], held.greedy[0]
    m = head.model
    with torch.no_grad():
        cache = m.new_cache(1, 64)
        x = m.forward_rows(m.embed_tokens(f.tokens)[None], m.project(f.aux)[None],
                           torch.arange(len(f.tokens))[None], torch.zeros(1, dtype=torch.long), cache)[0]
        drafted = m.to_target_ids(m.logits(x).argmax(-1))
    want = float((drafted == greedy)[f.loss_mask].float().mean())
    assert len(top1) == 3 and abs(top1[0] - want) < 1e-4
    assert all(0.0 <= a <= 1.0 for a in top1)


def _cfg(tiny, answers, out, **kw):
    base = dict(target=tiny["llama"], data=answers, steps=6, batch=2, seq_len=64, depths=3, draft_vocab=200,
                taps=(1, 3, 5), log_every=100, max_context=16, held_out_every=4, eval_every=3, lr=3e-3)
    return TrainConfig(output=out, **{**base, **kw})


def test_run_writes_its_curve_beside_the_head(tiny, answers, tmp_path):
    result = train(_cfg(tiny, answers, tmp_path / "head", curriculum=2), lambda *a, **k: None)
    rows = [json.loads(line) for line in (tmp_path / "head" / "curve.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 3, 6]  # before training, then every 3 steps
    assert all(len(r["top1"]) == 3 for r in rows) and rows[-1]["top1"] == result["held_out_top1"]
    assert rows[0]["train_cpu_s"] == 0 and rows[-1]["train_cpu_s"] > 0
    assert rows[-1]["supervised_seen"] > rows[1]["supervised_seen"] > 0
    assert (tmp_path / "head" / "curve.png").stat().st_size > 1000
    assert result["train_sequences"] == 6 and result["held_out_sequences"] == 2  # 8 answers, every 4th held out
    small = train(_cfg(tiny, answers, tmp_path / "small", steps=1, eval_every=0, train_sequences=3),
                  lambda *a, **k: None)
    assert small["train_sequences"] == 3 and small["held_out_sequences"] == 0
    newest = train(_cfg(tiny, answers, tmp_path / "newest", steps=1, train_from=4), lambda *a, **k: None)
    assert newest["train_sequences"] == 2 and newest["held_out_sequences"] == 2  # the held-out set stays
    with pytest.raises(ConfigError, match="--train-from 6"):
        train(_cfg(tiny, answers, tmp_path / "none", steps=1, train_from=6), lambda *a, **k: None)


def test_cpu_budget_ends_the_run_and_warm_start_continues(tiny, answers, tmp_path):
    first = train(_cfg(tiny, answers, tmp_path / "a", steps=10_000, cpu_budget_s=0.5, eval_every=0),
                  lambda *a, **k: None)
    assert 0 < first["steps"] < 10_000 and first["train_cpu_s"] >= 0.5
    warm = train(_cfg(tiny, answers, tmp_path / "b", steps=1, eval_every=0, lr=1e-12, warmup=1,
                      init_from=tmp_path / "a"), lambda *a, **k: None)
    cold = train(_cfg(tiny, answers, tmp_path / "c", steps=1, eval_every=0, lr=1e-12, warmup=1),
                 lambda *a, **k: None)
    assert warm["final_loss"] < cold["final_loss"]  # the warm head starts where the first run ended
    # a warm start keeps the head's draft vocabulary (a later run may train on other data)
    other = train(_cfg(tiny, answers, tmp_path / "d", steps=1, eval_every=0, draft_vocab=150, init_from=tmp_path / "a"),
                  lambda *a, **k: None)
    assert other["draft_vocab"] == first["draft_vocab"] == 200
    # a deeper head grows from it: the added layer adds nothing until trained, so the same first loss
    grown = train(_cfg(tiny, answers, tmp_path / "e", steps=1, eval_every=0, lr=1e-12, warmup=1, layers=2,
                       init_from=tmp_path / "a"), lambda *a, **k: None)
    assert grown["final_loss"] == pytest.approx(warm["final_loss"], rel=1e-6)
    with pytest.raises(CheckpointError, match="--layers 2"):  # a shallower one cannot hold it
        train(_cfg(tiny, answers, tmp_path / "f", steps=1, eval_every=0, init_from=tmp_path / "e"),
              lambda *a, **k: None)


@pytest.mark.parametrize("method,layout", [("peagle", "aws"), ("eagle3", "speculators")])
def test_a_warm_start_continues_its_heads_curve(tiny, answers, tmp_path, method, layout):
    kw = dict(method=method, layout=layout)
    train(_cfg(tiny, answers, tmp_path / "a", steps=3, **kw), lambda *a, **k: None)
    earlier = [json.loads(line) for line in (tmp_path / "a" / "curve.jsonl").read_text().splitlines()]
    train(_cfg(tiny, answers, tmp_path / "b", steps=3, init_from=tmp_path / "a", **kw), lambda *a, **k: None)
    rows = [json.loads(line) for line in (tmp_path / "b" / "curve.jsonl").read_text().splitlines()]
    assert rows[:len(earlier)] == earlier and [r.get("run", 0) for r in rows] == [0, 0, 1, 1]
    assert [r["step"] for r in rows] == [0, 3, 3, 6]  # steps, CPU and data counted on from the first run's end
    cpu = [r["train_cpu_s"] for r in rows]
    assert cpu == sorted(cpu) and cpu[2] == cpu[1]  # (3 tiny steps may round to +0.0 CPU s)
    assert rows[2]["supervised_seen"] == rows[1]["supervised_seen"] < rows[3]["supervised_seen"]
    assert rows[2]["top1"] == pytest.approx(rows[1]["top1"], abs=1e-3)  # the warm head evaluates as it ended


def test_init_layer_from_target_copies_the_last_layer(tiny):
    ckpt = load_target(tiny["llama"])
    cfg = TrainConfig(target=ckpt.path, output=ckpt.path, text=("x",), init_layer="target")
    head, _ = build_head(cfg, ckpt, (1, 3, 5), 3, torch.arange(0, ckpt.config.vocab_size, 2))
    last, fusion, h = ckpt.config.num_layers - 1, head.model.layers[0], ckpt.config.hidden_size
    torch.testing.assert_close(fusion.mlp.down_proj.weight, ckpt.tensors[f"layers.{last}.mlp.down_proj.weight"].float())
    torch.testing.assert_close(fusion.self_attn.q_proj.weight[:, h:],
                               ckpt.tensors[f"layers.{last}.self_attn.q_proj.weight"].float())
