"""`peagle-trt bench draft-length`: the adaptive rule on a simulated server, against every fixed K."""

from __future__ import annotations

import json

from peagle_trt.bench.cli import run_suite
from peagle_trt.bench.draft_length import FIXED_KS, simulate


def test_smoke_writes_the_table_and_json(tmp_path):
    result = run_suite("draft-length", ["--smoke", "--output-dir", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_draft_length.json").read_text())
    assert saved["smoke"] is True and len(saved["rows"]) == len(result["rows"]) == 12
    assert (tmp_path / "bench_draft_length.md").read_text().count("| good |") == 6
    assert all(0 < r["adaptive_over_best_fixed"] and r[r["best_fixed"]] == 1.0 for r in saved["rows"])


def test_the_model_has_an_interior_best_k_and_the_rule_finds_it_without_noise():
    """A good head on code at batch 1: neither K = 0 nor K = 7 is best (the verify's rows cost), and
    the rule, seeing only its own readings, comes within 2.5% of the best fixed K; on the weak head
    the best is K = 1 and the rule is as close (0.979: one step in 32 re-measures the runner-up,
    there k = 0, whose step also costs a catch-up pass). A rule change that explores or estimates
    worse fails (HOLD = 0.3: 0.929 on the good head, seed 2)."""
    for head, best_k in (("good", 3), ("weak", 1)):
        kinds = ["code"] * 30
        for seed in range(3):
            rate = {k: simulate(k, kinds, head, 1, seed, noise=0.0, drift=0.0) for k in FIXED_KS}
            assert max(rate, key=rate.get) == best_k
            assert simulate(None, kinds, head, 1, seed, noise=0.0, drift=0.0) >= 0.975 * rate[best_k]
