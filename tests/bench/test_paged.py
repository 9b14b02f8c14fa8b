"""Suite `paged` at smoke size on the tiny Llama: every phase runs, outputs are identical across
contenders, the paged runtime holds more requests at once than contiguous slots of the same
memory, and the prefix cache is hit."""

from __future__ import annotations

from peagle_trt.bench.cli import run_suite


def test_paged_suite_smoke(tiny, tmp_path, capsys):
    result = run_suite("paged", ["--target", str(tiny["llama"]), "--budget-mib", "4", "--max-seq-len", "256",
                                 "--requests", "8", "--short-tokens", "8", "--long-prompt", "100",
                                 "--system-tokens", "70", "--questions", "2", "--decode-tokens", "8",
                                 "--rounds", "1", "--output-dir", str(tmp_path)])
    assert "| capacity | paged |" in capsys.readouterr().out
    assert result["outputs_identical"] is True
    rows = {(r["phase"], r["contender"]): r for r in result["rows"]}
    assert rows[("capacity", "paged")]["peak_running"] > rows[("capacity", "contiguous")]["peak_running"]
    assert rows[("capacity", "paged")]["tokens"] == rows[("capacity", "contiguous")]["tokens"] == 8 * 8
    assert result["prefix_hit_tokens"] >= 2 * 64  # both timed requests reuse the 2 full blocks of the prefix
    assert {("prefix", "reuse"), ("prefix", "recompute"), ("block", "one block of 1024")} <= set(rows)
