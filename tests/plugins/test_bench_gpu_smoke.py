"""scripts/bench_gpu.py executes: its --smoke mode (tiny shapes, CPU here) runs every section the GPU
run has except FP8, writes the JSON / markdown report, and evaluates the issue-15 targets on what it
measured. The figures of a smoke run mean nothing; the GPU run is scripts/gpu_validate.sh.
About 5 s on the 2-core CI machine (in-process: no second torch import)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_bench_gpu_smoke_run_writes_the_report(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("bench_gpu_smoke_under_test", SCRIPTS / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    summary = module.main(["--smoke", "--out", str(tmp_path)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads(json.dumps(summary))  # the JSON last line
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
