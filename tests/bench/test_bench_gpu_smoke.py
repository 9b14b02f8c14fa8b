"""`peagle-trt bench gpu` executes: its --smoke mode (tiny shapes, CPU here) runs every section the GPU
run has except FP8 (the peers and the long-context rows included), writes the JSON / markdown report,
and evaluates the targets on what it measured; a peer that cannot run (here gpt-fast: CI has no
checkout) is a row with its error, the transformers peer runs (eager on a CPU: compile is off
there unless --peer-compile says otherwise); `--sections` runs a subset; a saved run is recorded
into a results file with the commit it measured. The figures of a smoke run mean nothing; the GPU
run is scripts/gpu_validate.sh. In-process (no second torch import)."""

from __future__ import annotations

import json

import pytest

from peagle_trt.bench import gpu_peers, results
from peagle_trt.cli import main
from peagle_trt.errors import ConfigError


def test_bench_gpu_smoke_run_writes_the_report(tmp_path, capsys):
    missing = tmp_path / "no-gpt-fast"
    assert main(["bench", "gpu", "--smoke", "--output-dir", str(tmp_path), "--gpt-fast", str(missing)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)  # the JSON last line: the results
    assert summary == json.loads((tmp_path / "bench_gpu.json").read_text())
    assert summary["errors"] == {} and summary["smoke"] is True and summary["commit"]
    results_ = json.loads((tmp_path / "bench_gpu.json").read_text())
    for section in ("copy", "drafter", "target", "iteration", "projection", "peers", "long-context", "profile"):
        assert results_.get(section), section
    assert {(r["batch"], r["k"]) for r in results_["drafter"]} == {(1, 1), (1, 3), (2, 1), (2, 3)}
    assert {r["mode"] for r in results_["iteration"]} == {"none", "eagle3", "peagle"}
    assert all(r["label"] == "PROJECTION" for r in results_["projection"])
    peers = {r["contender"]: r for r in results_["peers"]}
    assert set(peers) == {"peagle-trt", "gpt-fast", "transformers"}
    assert peers["gpt-fast"]["step_ms"] is None and "no such folder" in peers["gpt-fast"]["error"]
    assert str(missing) in peers["gpt-fast"]["error"]
    hf = peers["transformers"]
    assert hf["compile"] == "off" and hf["compiled"] is False and hf["tokens"] == [4, 7]
    assert hf["error"] is not None or (hf["step_ms"] > 0 and hf["over_ours"] > 0)
    assert peers["peagle-trt"]["over_ours"] == 1.0 and peers["peagle-trt"]["mbu"] > 0
    long = results_["long-context"]
    assert {(r["context"], r["part"], r["mode"]) for r in long} == {
        (c, p, m) for c in (32, 48) for p, m in (("forward", "decode"), ("forward", "verify"), ("step", "none"),
                                                  ("step", "peagle"))}
    report = (tmp_path / "bench_gpu.md").read_text()
    assert "SMOKE run" in report and "### Targets" in report and "PROJECTION" in report
    assert "beside the peers" in report and "Long contexts" in report
    targets = {t["target"]: t for t in summary["targets"]}
    assert list(targets)[0] == "parallel draft K=7 / K=1 (batch 1)"
    assert targets["decode step batch 1, ours / gpt-fast"]["value"] is None  # not measured: never guessed
    assert targets["decode batch 1: MBU"]["value"] is not None  # CPU: no graphs, the eager decode's name
    with pytest.raises(ConfigError, match="smoke"):
        results.record(tmp_path / "r.json", "gpu", [], summary)


def test_sections_run_a_subset_and_a_saved_run_is_recorded_with_its_commit(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PEAGLE_COMMIT", "feedc0de" * 5)
    assert main(["bench", "gpu", "--smoke", "--output-dir", str(tmp_path), "--sections", "target"]) == 0
    run = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert run["sections"] == ["copy", "target"] and run["commit"] == "feedc0de" * 5  # copy: the MBU's bandwidth
    assert run.get("copy") and run.get("target") and not run.get("peers") and not run.get("iteration")
    assert main(["bench", "gpu", "--smoke", "--sections", "bogus"]) != 0
    # a run brought back from a GPU machine, recorded here: figures by the current targets, its commit
    saved = tmp_path / "bench_gpu.json"
    run["smoke"] = False
    saved.write_text(json.dumps(run))
    doc = tmp_path / "results.json"
    entry = results.record_run(doc, saved, commit="abc1234" * 5)
    assert entry["commit"] == "abc1234" * 5 and entry["command"] == "peagle-trt bench gpu --smoke --sections target"
    assert [f["name"] for f in entry["figures"]] == ["GPU decode batch 1: MBU"]
    data = results.load(doc)
    data["headline"] = [["gpu", "GPU decode batch 1: MBU"]]
    assert "| abc1234 | [gpu](#gpu) |" in results.render(data)


def test_the_peers_resolve_their_compile_mode_and_refuse_a_wrong_checkout(tmp_path):
    import torch

    assert gpu_peers.resolve_compile("auto", torch.device("cpu")) == "off"
    assert gpu_peers.resolve_compile("auto", torch.device("cuda")) == "reduce-overhead"
    with pytest.raises(ConfigError, match="--peer-compile"):
        gpu_peers.resolve_compile("max", torch.device("cpu"))
    with pytest.raises(ConfigError, match="no gpt-fast checkout given"):
        gpu_peers.load_gpt_fast(None)
    (tmp_path / "model.py").write_text("")
    with pytest.raises(ConfigError, match="missing generate.py"):
        gpu_peers.load_gpt_fast(tmp_path)
