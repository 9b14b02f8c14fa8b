"""Suite `speculation` end to end at smoke size on the 1 M-parameter code pair (torch backend): the
synthetic sweep reaches its configured acceptance lengths and marks its rows; adaptive K and every
fixed K give outputs identical to none's; the verdict compares adaptive with the best fixed K;
the per-request oracle is computed as its docstring says."""

from __future__ import annotations

import json

import pytest

from peagle_trt.bench.cli import run_suite


def test_speculation_suite_smoke(tmp_path):
    result = run_suite("speculation", ["--smoke", "--output-dir", str(tmp_path)])
    assert json.loads((tmp_path / "bench_speculation.json").read_text())["smoke"] is True
    synth = [r for r in result["synthetic"] if r["synthetic_acceptance"]]
    assert {r["batch"] for r in synth} == {1, 8} and all(r["mismatches"] is None for r in synth)
    full = [r for r in synth if r["config"] == "synthetic AL 4"]  # K = 3, every draft accepted
    assert full and all(r["acceptance_length"] == pytest.approx(4.0, abs=0.01) for r in full)
    assert all(r["acceptance_length"] == 1.0 for r in synth if r["config"] == "synthetic AL 1")
    adaptive = result["adaptive"]
    assert {r["config"] for r in adaptive} == {"none", "K=1", "K=3", "adaptive (K<=3)"}
    assert all(r["mismatches"] == 0 for r in adaptive)  # identical to the target alone
    verdicts = result["adaptive_vs_best_fixed"]
    assert {(v["workload"], v["batch"]) for v in verdicts} == {(w, b) for w in ("humaneval", "heldout", "mixed")
                                                              for b in (1, 8)}
    assert all(len(v["per_round"]) == 1 and v["adaptive_over_best_fixed"] == v["per_round"][0] for v in verdicts)
    assert (tmp_path / "bench_speculation.md").is_file() and (tmp_path / result["plot"]).is_file()
    requests = result["per_request"]
    assert [r["workload"] for r in requests if r["config"] == "none"] == ["humaneval/0", "heldout/0", "long/0"]
    assert all(r["mismatches"] == 0 for r in requests) and len(requests) == 3 * 4
    assert [v["kind"] for v in result["per_kind"]] == ["humaneval", "heldout", "long", "mixed"]
    assert all(v["oracle_over_best_fixed"] >= 1.0 for v in result["per_kind"])


def test_verdict_held_out_pick_is_not_the_round_it_judges():
    """In-sample, K=1 wins on one lucky round and adaptive reads 0.95 of it; held out, each round
    is judged against the configuration the other rounds pick (none, K=1, K=1)."""
    from peagle_trt.bench.speculation import verdicts

    def row(config, walls, adaptive=False):
        return {"workload": "mixed", "batch": 1, "config": config, "adaptive": adaptive, "tokens": 100,
                "wall_s_passes": walls, "tokens_per_s": 100 / sorted(walls)[len(walls) // 2]}

    (v,) = verdicts([row("none", [1.0, 1.0, 1.0]), row("K=1", [0.8, 1.25, 0.95]),
                     row("adaptive (K<=3)", [1.0, 1.0, 1.0], adaptive=True)])
    assert v["best_fixed"] == "K=1" and v["adaptive_over_best_fixed"] == 0.95
    assert v["per_round"] == [0.8, 1.25, 0.95]
    assert v["best_fixed_held_out"] == ["none", "K=1", "K=1"]
    assert v["per_round_held_out"] == [1.0, 1.25, 0.95] and v["adaptive_over_best_fixed_held_out"] == 1.0


def test_oracle_takes_each_requests_fastest_fixed_k():
    """Code gains with K=1, long loses: the best fixed K of the mix is none (10 s against 10.4 s),
    and each request with its own fastest (1.5 + 1.9 + 6 = 9.4 s) is 10 / 9.4 = 1.064 of it."""
    from peagle_trt.bench.speculation import oracle

    def rows(workload, none, k1, adaptive):  # `measure`'s rows, one pass each
        return [{"workload": workload, "config": c, "adaptive": c.startswith("adaptive"), "wall_s_passes": [w]}
                for c, w in (("none", none), ("adaptive (K<=3)", adaptive), ("K=1", k1))]

    by_kind = {v["kind"]: v for v in oracle(rows("code/0", 2.0, 1.5, 1.6) + rows("code/1", 2.0, 1.9, 2.0)
                                            + rows("long/0", 6.0, 7.0, 6.2))}
    assert by_kind["code"]["best_fixed"] == "K=1" and by_kind["long"]["best_fixed"] == "none"
    assert by_kind["code"]["oracle_over_best_fixed"] == 1.0 and by_kind["long"]["oracle_over_best_fixed"] == 1.0
    mixed = by_kind["mixed"]
    assert mixed["requests"] == 3 and mixed["best_fixed"] == "none"
    assert mixed["speedup"] == {"none": 1.0, "adaptive (K<=3)": round(10 / 9.8, 3), "K=1": round(10 / 10.4, 3)}
    assert mixed["oracle_over_best_fixed"] == round(10 / 9.4, 3)
    assert mixed["adaptive_over_best_fixed"] == {"adaptive (K<=3)": round(10 / 9.8, 3)}
