"""Self-distillation (peagle_trt/train/distill.py) and the training-data paths it feeds: answers written as
requests finish, a resumed run skips what is done, a spent budget keeps finished answers only;
`train --data` reads distilled rows (plain or gzipped) without answering again; the target's pass is cached
(in memory and in a shared file, by content) without changing the features; text trains beside the
answers as extra pieces (held out from the answers only); frozen embeddings ship no table."""

from __future__ import annotations

import gzip
import json

import torch
from safetensors.torch import load_file

from peagle_trt.checkpoint import load_drafter, load_pair, load_target
from peagle_trt.config import SpecConfig
from peagle_trt.make_tiny import CORPUS
from peagle_trt.models.target import TargetModel
from peagle_trt.tokenizer import TextCodec
from peagle_trt.train import TrainConfig, train
from peagle_trt.train import data as D
from peagle_trt.train.distill import distill, read_done


def _rows(n):
    return [{"id": f"r{i}", "kind": "write", "prompt": CORPUS[i % len(CORPUS)], "max_tokens": 6 + i % 3}
            for i in range(n)]


def test_distill_writes_answers_and_resumes(tiny, tmp_path):
    out = tmp_path / "answers.jsonl"
    first = distill(tiny["llama"], _rows(3), out, backend="torch", batch=2, max_len=256)
    assert first["answered"] == 3 and read_done(out) == {"r0", "r1", "r2"}
    again = distill(tiny["llama"], _rows(5), out, backend="torch", batch=2, max_len=256)
    assert again["already_done"] == 3 and again["answered"] == 2
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == [f"r{i}" for i in range(5)]
    assert all(len(r["response_ids"]) <= 8 and r["prompt_ids"] for r in rows)


def test_distilled_answers_are_the_targets_greedy_answers(tiny, tmp_path):
    """distill (onnxruntime) and regenerate_all (torch) run the same scheduler path: same answers."""
    out = tmp_path / "answers.jsonl"
    rows = [dict(r, max_tokens=8) for r in _rows(3)]
    distill(tiny["llama"], rows, out, backend="onnxruntime", batch=3, max_len=128)
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    ckpt = load_target(tiny["llama"])
    target = TargetModel.from_tensors(ckpt.config, ckpt.tensors, (), "cpu", torch.float32, "t")
    prompts = [got[f"r{i}"]["prompt_ids"] for i in range(3)]
    ref = D.regenerate_all(target, prompts, 8, 0.0, (), seed=0, batch=2)
    assert [got[f"r{i}"]["response_ids"] for i in range(3)] == ref


def test_spent_budget_keeps_only_finished_answers(tiny, tmp_path):
    out = tmp_path / "answers.jsonl"
    result = distill(tiny["llama"], _rows(6), out, backend="torch", batch=2, max_len=256, budget_s=1e-9)
    lines = out.read_text().splitlines() if out.exists() else []
    assert result["answered"] == len(lines) < 6


def test_train_reads_distilled_rows_and_shares_the_feature_cache(tiny, tmp_path):
    data = tmp_path / "answers.jsonl"
    distill(tiny["llama"], [dict(r, max_tokens=12) for r in _rows(4)], data, backend="torch", batch=2,
            max_len=256)
    cache = tmp_path / "features.pt"
    base = dict(target=tiny["llama"], data=data, steps=3, batch=2, seq_len=64, depths=3, draft_vocab=200,
                taps=(1, 3, 5), log_every=100, feature_cache=cache, max_context=16)
    a = train(TrainConfig(output=tmp_path / "a", **base), lambda *a, **k: None)
    assert cache.is_file()
    lines = []
    b = train(TrainConfig(output=tmp_path / "b", **base), lambda line, final=False: lines.append(line))
    assert any("read from" in line for line in lines)  # the second run used the file
    assert a["final_loss"] == b["final_loss"]  # and the features were the same
    packed = tmp_path / "answers.jsonl.gz"  # the committed form of a distilled set
    packed.write_bytes(gzip.compress(data.read_bytes()))
    assert D.read_distilled(packed) == D.read_distilled(data) and len(D.read_distilled(data)) == 4


def test_text_beside_answers_adds_pieces_and_reuses_the_cached_answers(tiny, tmp_path):
    data = tmp_path / "answers.jsonl"
    distill(tiny["llama"], [dict(r, max_tokens=10) for r in _rows(6)], data, backend="torch", batch=3,
            max_len=256)
    text = tmp_path / "t.txt"
    text.write_text("\n".join(CORPUS * 6))
    cache = tmp_path / "features.pt"
    base = dict(target=tiny["llama"], data=data, steps=2, batch=2, seq_len=64, depths=2, draft_vocab=200,
                max_context=16, taps=(1, 3, 5), log_every=100, feature_cache=cache, held_out_every=3, eval_every=1)
    answers = train(TrainConfig(output=tmp_path / "a", **base), lambda *a, **k: None)
    lines = []
    both = train(TrainConfig(output=tmp_path / "b", text=(text,), **base),
                 lambda line, final=False: lines.append(line))
    assert answers["train_sequences"] == 4 and answers["held_out_sequences"] == 2
    pieces = both["train_sequences"] - 4
    assert pieces > 1 and both["held_out_sequences"] == 2  # held out from the answers only
    assert any(f"4 answers and {pieces} text pieces of 64 tokens" in line for line in lines)
    assert any("read from" in line for line in lines)  # the answers' passes came from the file
    filled = [line for line in lines if line.startswith("target features:")]
    assert filled and filled[-1].startswith(f"target features: {4 + pieces}/{4 + pieces}")
    # the first run's file is kept as it was; the second appended only its new passes, as a part
    assert len(torch.load(cache, weights_only=True)["kept"]) == 4
    assert len(torch.load(tmp_path / "features.pt.part-0001", weights_only=True)["kept"]) == pieces
    again = []
    train(TrainConfig(output=tmp_path / "c", text=(text,), **base), lambda line, final=False: again.append(line))
    assert any(f"features of {4 + pieces} sequences read from" in line for line in again)  # both files read
    assert not (tmp_path / "features.pt.part-0002").exists()  # and nothing new to write


def test_cached_features_equal_the_full_forward(tiny):
    ckpt = load_target(tiny["llama"])
    target = TargetModel.from_tensors(ckpt.config, ckpt.tensors, (1, 3, 5), "cpu", torch.float32, "t")
    ids = torch.tensor([1, 5, 9, 14, 3, 7, 22, 8, 2, 11])
    sup = torch.ones_like(ids, dtype=torch.bool)
    draft_ids = torch.arange(0, 200, 2)
    logits, aux = target(ids[None], torch.arange(len(ids))[None], torch.zeros(1, dtype=torch.long),
                         target.new_cache(1, len(ids)))
    cache = D.FeatureCache(target, draft_ids)
    f = cache.get(0, ids, sup)
    assert torch.allclose(f.probs, torch.softmax(logits[0, 1:, draft_ids], -1), atol=2e-3)
    assert f.aux.dtype == torch.float16  # kept as the cache keeps it, made float per block (train/forward.py)
    assert torch.allclose(f.aux.float(), aux[0, :-1], atol=1e-2, rtol=1e-3)
    assert cache.get(0, ids, sup).probs.equal(f.probs)  # kept, not recomputed differently


def test_frozen_embeddings_and_fc_norms_round_trip(tiny, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("\n".join(CORPUS * 4))
    out = tmp_path / "head"
    train(TrainConfig(target=tiny["llama"], output=out, text=(text,), steps=2, batch=1, seq_len=32, depths=3,
                      draft_vocab=200, taps=(1, 3, 5), freeze_embeddings=True, mask_token_id=3, log_every=100,
                      fc_norm=True), lambda *a, **k: None)
    tensors = load_file(str(out / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors and "fc_norm.2.weight" in tensors
    assert not load_drafter(out).config.has_embed and load_drafter(out).config.fc_norm
    target, drafter = load_pair(tiny["llama"], out, SpecConfig("peagle", 3)).build()
    assert drafter.embed_tokens.weight.equal(target.embed_tokens.weight)


def test_text_pieces_of_several_sizes_and_a_held_out_text_curve(tiny, tmp_path):
    codec = TextCodec(tiny["llama"])
    data = tmp_path / "answers.jsonl"  # distilled rows as train/distill.py writes them (no generation here)
    ids = [codec.tok(line, add_special_tokens=False)["input_ids"] for line in CORPUS[:6]]
    data.write_text("".join(json.dumps({"prompt_ids": x[:5], "response_ids": x[5:15]}) + "\n" for x in ids))
    text, held = tmp_path / "t.txt", tmp_path / "h.txt"
    text.write_text("\n".join(CORPUS))
    held.write_text("\n".join(CORPUS[::-1]))
    cache = tmp_path / "features.pt"
    cfg = TrainConfig(target=tiny["llama"], output=tmp_path / "a", data=data, text=(text,), text_piece=(64, 32),
                      held_out_text=(held,), steps=1, batch=2, seq_len=48, depths=2, draft_vocab=200,
                      max_context=16, taps=(1, 3, 5), log_every=100, feature_cache=cache, held_out_every=3,
                      eval_every=1, segment_tokens=16)
    lines = []
    out = train(cfg, lambda line, final=False: lines.append(line))
    pieces = out["train_sequences"] - 4
    assert pieces > 2 and any(f"{pieces} text pieces of 48/32 tokens" in line for line in lines)  # 64 cut to 48
    cut = D.text_corpus(codec.tok, [text], codec.eos_ids[0], (48, 32)).sequences
    assert [len(s) for s in cut[:4]] == [48, 32, 48, 32] and len(cut) == pieces  # sizes in turn
    rows = [json.loads(line) for line in (tmp_path / "a" / "curve.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(len(r["top1_text"]) == 2 for r in rows)
    assert all(set(r["top1_text_by_position"]) == {"0-2047"} for r in rows)
    assert rows[0]["top1_text_by_position"]["0-2047"] == rows[0]["top1_text"]  # one span: the same rates
    assert [r["step"] for r in rows] == [0, 1] and all(0 <= a <= 1 for r in rows for a in r["top1_text"])
    # the held-out text's passes were kept in the cache file beside the training sequences' (a resumed run reads them)
    kept = {k for f in tmp_path.glob("features.pt*") for k in torch.load(f, weights_only=True)["kept"]}
    held_pieces = len(D.text_corpus(codec.tok, [held], codec.eos_ids[0], (48, 32)).sequences)
    assert held_pieces > 1 and len(kept) == 4 + pieces + held_pieces
