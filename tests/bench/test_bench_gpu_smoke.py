"""`peagle-trt bench gpu` executes: its --smoke mode (tiny shapes, CPU here) runs every section the GPU
run has except FP8, writes the JSON / markdown report, and evaluates the issue-15 targets on what it
measured. The figures of a smoke run mean nothing; the GPU run is scripts/gpu_validate.sh.
About 5 s on the 2-core CI machine (in-process: no second torch import)."""

from __future__ import annotations

import json

from peagle_trt.cli import main


def test_bench_gpu_smoke_run_writes_the_report(tmp_path, capsys):
    assert main(["bench", "gpu", "--smoke", "--output-dir", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)  # the JSON last line: the results
    assert summary == json.loads((tmp_path / "bench_gpu.json").read_text())
    assert summary["errors"] == {} and summary["smoke"] is True
    results = json.loads((tmp_path / "bench_gpu.json").read_text())
    for section in ("copy", "drafter", "target", "iteration", "projection"):
        assert results.get(section), section
    assert {(r["batch"], r["k"]) for r in results["drafter"]} == {(1, 1), (1, 3), (2, 1), (2, 3)}
    assert {r["mode"] for r in results["iteration"]} == {"none", "eagle3", "peagle"}
    assert all(r["label"] == "PROJECTION" for r in results["projection"])
    report = (tmp_path / "bench_gpu.md").read_text()
    assert "SMOKE run" in report and "## Targets (issue 15)" in report and "PROJECTION" in report
    assert [t["target"] for t in summary["targets"]][0] == "parallel draft K=7 / K=1 (batch 1)"
