"""Suites `heads` and `acceptance` (peagle_trt/bench/measure.py) end to end at smoke size on the 1 M-parameter code
pair (torch backend): the in-process acceptance table and the alternated batch-1 and batch-8 timing (seconds), and,
slow, the served phase through a real tritonserver; greedy speculative outputs equal `none`'s
everywhere, and the JSON carries the table's figures."""

from __future__ import annotations

import json

import pytest

from peagle_trt.bench.cli import run_suite


def test_heads_suite_smoke(tmp_path, capsys):
    result = run_suite("heads", ["--smoke", "--output-dir", str(tmp_path)])
    assert "| method | K | AL HumanEval" in capsys.readouterr().out
    assert json.loads((tmp_path / "bench_heads.json").read_text())["smoke"] is True
    rows = {(r["method"], r["K"]): r for r in result["rows"]}
    assert set(rows) == {("none", 0), ("peagle", 3), ("eagle3", 3)}
    assert all(r["mismatches"] == 0 for r in result["rows"])  # identical to the target alone
    assert rows[("peagle", 3)]["humaneval"]["acceptance_length"] > 1.0  # the trained pair accepts drafts
    assert len(rows[("peagle", 3)]["humaneval"]["accept_rate_per_pos"]) == 3
    assert {"heldout", "long"} <= set(rows[("peagle", 3)]) and "humaneval_t0.7" in rows[("eagle3", 3)]
    assert [r["method"] for r in result["batch1"]] == ["none", "peagle", "eagle3"]
    assert result["batch1"][0]["speedup"] == 1.0 and all(r["mismatches"] == 0 for r in result["batch1"])
    assert [(r["method"], r["batch"]) for r in result["batch8"]] == [("none", 8), ("peagle", 8), ("eagle3", 8)]
    assert all(r["mismatches"] == 0 for r in result["batch8"])  # alternated at batch 8: the same outputs
    assert any("batch 8, peagle K=3 over none" in f["name"] for f in result["figures"])
    assert result["served"] is None and (tmp_path / "bench_heads.md").is_file()


def test_acceptance_only(tmp_path, monkeypatch):
    """--timing-prompts 0: the acceptance table alone (one configuration at a time: any number of them
    fits in memory), no timed phase and no speed figure."""
    from peagle_trt.bench import heads

    monkeypatch.setitem(heads.SMOKE, "timing_prompts", 0)
    monkeypatch.setitem(heads.SMOKE, "configs", "none,peagle:1,peagle:3")
    result = run_suite("heads", ["--smoke", "--output-dir", str(tmp_path)])
    assert [(r["method"], r["K"]) for r in result["rows"]] == [("none", 0), ("peagle", 1), ("peagle", 3)]
    assert all(r["mismatches"] == 0 for r in result["rows"])
    assert result["batch1"] == [] and result["batch8"] == [] and result["served"] is None
    assert not any("over none" in f["name"] for f in result["figures"])
    report = (tmp_path / "bench_heads.md").read_text()
    assert "acceptance only (no timed phase)" in report and "### Batch 1" not in report


@pytest.mark.slow  # ~1 min: three models built and served
@pytest.mark.triton
def test_served_phase(tmp_path):
    pytest.importorskip("pytriton")
    result = run_suite("acceptance", ["--smoke", "--workdir", str(tmp_path / "work"), "--output-dir", str(tmp_path)])
    assert [r["method"] for r in result["served"]] == ["none", "peagle", "eagle3"]
    assert [r["mismatches"] for r in result["served"]] == [0, 0, 0]
    assert any(f["name"].endswith("over none (served, CPU)") for f in result["figures"])
