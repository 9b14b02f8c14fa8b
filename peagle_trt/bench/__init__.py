"""Benchmark suites, one per section of docs/BENCHMARKS.md, run as `peagle-trt bench SUITE [options]`.

The registry and the common options are in peagle_trt/bench/cli.py; shared helpers (closed-loop load,
HumanEval reader, CPU counters) in peagle_trt/bench/common.py; the output contract (a markdown report on
stdout and in --output-dir, optional plots, the JSON results as the last stdout line) in
peagle_trt/bench/report.py.
"""
