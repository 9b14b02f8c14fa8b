"""Suite `long-context` (peagle_trt/bench/long_context.py) at smoke size on the 1 M-parameter code pair (torch
backend): every greedy output equal to none's, one table row per (context, configuration); and its prompt
sets (peagle_trt/bench/long_prompts.py): deterministic, within their token budget, and disjoint from what the
heads train on (the training split's modules and the answers `peagle-trt train` does not hold out)."""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict

import pytest

from peagle_trt.bench import long_context, long_prompts
from peagle_trt.bench.cli import run_suite
from peagle_trt.errors import ConfigError


@pytest.fixture(scope="module")
def codec():
    from peagle_trt.bench.harness import model_dir
    from peagle_trt.tokenizer import TextCodec

    return TextCodec(model_dir("code-pair"))


def test_long_context_suite_smoke(tmp_path, capsys):
    result = run_suite("long-context", ["--smoke", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| context | prompt tokens | config | AL | per-position | decode tok/s |" in out
    rows = result["rows"]
    contexts = [int(c) for c in long_context.SMOKE["contexts"].split(",")]
    assert [(r["context_tokens"], r["config"]) for r in rows] == [
        (c, name) for c in contexts for name in ("none", "peagle K=3", "eagle3 K=3")]
    assert all(r["mismatches"] == 0 for r in rows)  # greedy speculative output == the target alone's
    for r in rows:
        assert len(r["prompt_tokens"]) == 2 and all(n <= r["context_tokens"] for n in r["prompt_tokens"])
        assert r["decode_tokens_per_s"] > 0 and r["ttft_s"] > 0
        assert len(r["accept_rate_per_pos"]) == r["K"]
        assert r["speedup"] == 1.0 if r["config"] == "none" else r["acceptance_length"] >= 1.0
    assert any(r["acceptance_length"] > 1.0 for r in rows)  # the trained pair accepts drafts
    names = [f["name"] for f in result["figures"]]
    assert len(names) == 3 and f"AL at {contexts[1]} over at {contexts[0]}" in names[0]
    assert [asdict(f) for f in long_context.refigure(result)] == result["figures"]  # --record-run re-derives them
    assert json.loads((tmp_path / "bench_long_context.json").read_text())["smoke"] is True


def test_configs_parsed_and_checked(tmp_path):
    import argparse

    from peagle_trt.bench.harness import model_dir

    target = model_dir("code-pair")
    args = argparse.Namespace(target=target, configs="none,peagle:1,mine:2", peagle=None, eagle3=None,
                              heads=f"mine={target / 'drafter-eagle3'}")
    configs = long_context.parse_configs(args)
    assert [(c.name, c.spec.mode, c.spec.num_spec_tokens) for c in configs] == [
        ("none", "none", 0), ("peagle K=1", "peagle", 1), ("mine K=2", "eagle3", 2)]
    for cfg, method in (({"mask_token_id": 5}, "peagle"), ({}, "eagle3")):  # a head without a training record
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        assert long_context.head_method(tmp_path) == method
    for bad in ("peagle:1,none", "none,peagle:0", "none,other:1", "none,peagle"):
        with pytest.raises(ConfigError):
            long_context.parse_configs(argparse.Namespace(**{**vars(args), "configs": bad}))


def test_prompts_deterministic_and_within_budget(codec):
    a = long_prompts.long_prompts(codec, 700, count=2, seed=3)
    b = long_prompts.long_prompts(codec, 700, count=2, seed=3)
    assert a == b  # the same list for the same seed and installed packages
    assert [p.kind for p in a] == ["source", "source", "chat", "chat"]
    assert len({p.ids for p in a}) == 4  # distinct prompts
    for p in a:
        assert (1 - 0.25) * 700 <= p.tokens <= 700  # filled close to, never over, the budget
    src = a[0]
    assert f"`{src.parts[-1]}`" in src.request  # a request about the LAST file
    assert codec.decode(list(src.ids)).count("# file: ") == len(src.parts)
    assert long_prompts.long_prompts(codec, 700, count=1, seed=4)[0] != a[0]
    with pytest.raises(ConfigError):
        long_prompts.long_prompts(codec, 700, kinds=("poems",))


def test_prompts_held_out_from_training(codec):
    from peagle_trt.train.config import TrainConfig
    from peagle_trt.train.curve import split
    from peagle_trt.train.instructions import source_files, split_of

    prompts = long_prompts.long_prompts(codec, 900, count=2, seed=0)
    modules = {m for p in prompts if p.kind == "source" for m in p.parts}
    assert modules and all(split_of(m) == "heldout" for m in modules)
    trained = {str(path) for path in source_files(10 ** 9)}  # what the training helper reads (stdlib)
    assert not trained & {str(path) for name, path in long_prompts.heldout_modules(0) if name in modules}
    # the chat turns: held-out answer rows (train's split of the non-empty answers), or held-out modules
    for part in (x for p in prompts if p.kind == "chat" for x in p.parts):
        kind, _, ref = part.partition(":")
        assert kind in ("answers", "module")
        if kind == "module":  # the stand-ins of a target that cannot read the answers
            assert split_of(ref) == "heldout"
    # the answers' held-out rows are the ones `peagle-trt train --data ANSWERS` holds out by default
    with gzip.open(long_prompts.ANSWERS, "rt", encoding="utf-8") as f:
        answered = sum(1 for line in f if line.strip() and json.loads(line)["response_ids"])
    _, held = split(answered, TrainConfig.__dataclass_fields__["held_out_every"].default)
    assert [r for r, _, _ in long_prompts.heldout_answers()] == held and len(held) > 100
