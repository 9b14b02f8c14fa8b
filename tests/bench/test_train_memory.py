"""Suite `train-memory` at --smoke size on the tiny llama: one row per (length, partitioning), the flat
setting only up to --flat-max, the report, the plot and the headline figure (the partitioned spread)."""

from __future__ import annotations

import json

from peagle_trt.bench.cli import run_suite


def test_smoke_measures_every_setting(tiny, tmp_path):
    result = run_suite("train-memory", ["--smoke", "--target", str(tiny["llama"]), "--output-dir", str(tmp_path)])
    assert result == json.loads((tmp_path / "bench_train_memory.json").read_text()) and result["smoke"] is True
    report = (tmp_path / "bench_train_memory.md").read_text()
    assert report.startswith("## train-memory") and "machine: " in report and "|---" in report
    assert [(r["tokens"], r["partitions"]) for r in result["rows"]] == [
        (48, "partitions of 32"), (48, "none (flat)"), (96, "partitions of 32")]
    assert all(r["step_peak_mib"] >= 0 and r["rss_before_mib"] > 0 and r["elements"] > 48 for r in result["rows"])
    assert result["rows"][2]["elements"] > result["rows"][0]["elements"]
    # >= 0: on the tiny llama a step may allocate nothing past the resident set it started from
    assert result["figures"][0]["value"] == result["partitioned_spread"] >= 0
    assert (tmp_path / "bench_train_memory.png").stat().st_size > 1000
