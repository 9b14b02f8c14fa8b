"""docs/results.json -> the headline table of docs/BENCHMARKS.md (`peagle-trt bench report`: the
`headline` figures with their target and met / missed), and the README's quoted figures against that
table."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from peagle_trt.bench import results
from peagle_trt.bench.cli import SUITES
from peagle_trt.demo import SMOLLM2_K
from peagle_trt.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DOC, RESULTS = ROOT / "docs" / "BENCHMARKS.md", ROOT / "docs" / "results.json"
# a figure the README quotes: (pattern around the number in README.md, the figure's name in results.json)
DECODE = "SmolLM2-135M decode, batch 1: ours (onnxruntime)"
# the demo serves the head's best K of the recorded run; the README quotes that K and its figures
HEADS = f"smollm2-135m-instruct, HumanEval batch 1, peagle K={SMOLLM2_K} over none"
README_FIGURES = [
    (r"decodes at ([\d.]+x) transformers' own", f"{DECODE} over transformers' generate"),
    (r"and (\d+%) of the memory-bandwidth roofline", f"{DECODE}, share of the bandwidth roofline"),
    (rf"\(K = {SMOLLM2_K};[^)]*\) decodes ([\d.]+x) as fast as the target alone in process",
     f"{HEADS} (in-process, CPU)"),
    (r"alone in process and ([\d.]+x) served", f"{HEADS} (served, CPU)"),
]


def test_the_committed_table_is_the_rendered_one():
    table = results.render(results.load(RESULTS))
    assert results.block(DOC.read_text()) == table, "run `peagle-trt bench report --write`"


def test_the_headline_is_a_first_screen_of_real_figures():
    data = results.load(RESULTS)
    rows = results.render(data).splitlines()[2:]
    assert 10 <= len(rows) <= 15, len(rows)
    assert all("`" not in row for row in rows), "commands live in the sections and docs/results.json"
    assert {suite for suite, _ in data["headline"]} >= {"heads", "decode", "gpu", "kernels", "paged", "fp8-quality"}
    doc = DOC.read_text()
    assert doc.index(results.BEGIN) < 800, "the table opens the page"


def test_met_reads_the_target_and_a_missing_headline_figure_is_refused():
    f = results.Figure
    assert results.met(f("a", 1.40, "x", ">= 1.6x")) == "**missed**"
    assert results.met(f("a", 1.6, "x", ">= 1.6x")) == "met"
    assert results.met(f("a", 0.291, "ms", "<= 0.3 ms", 3)) == "met"
    assert results.met(f("a", 84.0, "%", ">= 60%", 0)) == "met"
    assert results.met(f("a", 5.83, "", "<= 0.3")) == "**missed**"
    assert results.met(f("a", 1.0, "x")) == ""
    with pytest.raises(ConfigError, match="headline"):
        results.render({"headline": [["heads", "gone"]], "suites": {}})


def test_every_suite_in_the_results_is_registered_and_has_its_section():
    data, doc = results.load(RESULTS), DOC.read_text()
    for suite, entry in data["suites"].items():
        assert suite in SUITES and f'<a id="{suite}"></a>' in doc, suite
        assert entry["figures"] and re.match(r"(OMP_NUM_THREADS=1 )?peagle-trt bench ", entry["command"]), suite


def test_the_readme_quotes_the_table():
    readme = " ".join((ROOT / "README.md").read_text().split())
    figures = {f["name"]: results.Figure(**f).text() for e in results.load(RESULTS)["suites"].values()
               for f in e["figures"]}
    table = results.block(DOC.read_text())
    for pattern, name in README_FIGURES:
        quoted = re.search(pattern, readme)
        assert quoted, pattern
        assert quoted.group(1) == figures[name] and f"**{figures[name]}**" in table, (quoted.group(1), name)


def test_record_replaces_one_suite_and_refuses_a_smoke_run(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"suites": {"other": {"command": "c", "machine": "m", "date": "d", "figures": []}}}))
    run = {"smoke": False, "machine": {"cores": 2, "cpu": "CPU X", "gpu": None, "date": "2026-01-02T03:04:05+00:00"},
           "figures": [{"name": "f", "value": 1.234, "unit": "ms", "target": "<= 2 ms", "digits": 2}]}
    argv = ["--steps", "9", "--output-dir", "o", "--workdir=/tmp/w", "--record", str(path)]  # outputs: dropped
    results.record(path, "scheduler", argv, run)
    data = results.load(path)
    assert set(data["suites"]) == {"other", "scheduler"}
    assert data["suites"]["scheduler"] == {"command": "peagle-trt bench scheduler --steps 9", "machine": "2-core CPU X",
                                           "date": "2026-01-02", "figures": run["figures"]}
    data["headline"] = [["scheduler", "f"]]
    assert "| f | **1.23 ms** | <= 2 ms | met | 2-core CPU X | 2026-01-02 |" in results.render(data)
    with pytest.raises(ConfigError, match="smoke"):
        results.record(path, "scheduler", [], {**run, "smoke": True})


def test_write_puts_the_table_between_the_markers(tmp_path):
    doc = tmp_path / "B.md"
    doc.write_text(f"# B\n\n{results.BEGIN}\nold\n{results.END}\n\n## after\n")
    results.write(doc, "| new |")
    assert doc.read_text() == f"# B\n\n{results.BEGIN}\n| new |\n{results.END}\n\n## after\n"
    assert results.block(doc.read_text()) == "| new |"
