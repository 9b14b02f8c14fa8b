"""Suite `curves`: recipes compared at equal training CPU time from curve.jsonl files (the smoke run
reads two synthetic ones); the interpolation between evaluations, never past a curve's end."""

from __future__ import annotations

import pytest

from peagle_trt.bench.cli import run_suite
from peagle_trt.bench.curves import at, read_curve
from peagle_trt.errors import ConfigError


def test_smoke_compares_the_recipes_at_common_marks(tmp_path):
    result = run_suite("curves", ["--smoke", "--output-dir", str(tmp_path)])
    assert result["best"] == "smoke-fast" and set(result["recipes"]) == {"smoke-fast", "smoke-slow"}
    finals = [r for r in result["rows"] if r["at"] == "final"]
    assert len(finals) == 2 and len(result["rows"]) == 2 * 5  # 4 marks + the final row, per recipe
    assert result["marks_cpu_s"][-1] == 300  # the shortest run's CPU time: every recipe has every mark
    assert all("top1_pos1" in r for r in result["rows"])
    assert [f["name"].split(": ")[1] for f in result["figures"]] == ["final position-1 top-1",
                                                                     "final chain_accepted_k7"]
    pytest.importorskip("matplotlib")
    assert (tmp_path / "bench_curves.png").is_file()
    assert "![bench_curves.png](bench_curves.png)" in (tmp_path / "bench_curves.md").read_text()


def test_interpolation_and_bad_input(tmp_path):
    rows = [{"step": 0, "train_cpu_s": 0.0, "loss": 4.0, "top1": [0.2], "chain_accepted_k7": 1.0},
            {"step": 100, "train_cpu_s": 100.0, "loss": 2.0, "top1": [0.4], "chain_accepted_k7": 2.0}]
    mid = at(rows, 25.0)
    assert mid["step"] == 25 and mid["loss"] == 3.5 and mid["top1_pos1"] == pytest.approx(0.25)
    assert at(rows, 150.0) is None  # never extrapolated
    warm = rows + [{"step": 100, "train_cpu_s": 100.0, "loss": None, "top1": [0.4], "chain_accepted_k7": 2.0, "run": 1},
                   {"step": 200, "train_cpu_s": 200.0, "loss": 1.0, "top1": [0.6], "chain_accepted_k7": 3.0, "run": 1}]
    assert at(warm, 150.0)["loss"] == 1.0 and at(warm, 150.0)["top1_pos1"] == pytest.approx(0.5)  # a warm start
    (tmp_path / "curve.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="without"):
        read_curve(tmp_path)
    with pytest.raises(ConfigError, match="no learning curve"):
        read_curve(tmp_path / "missing")
