"""Benchmark suites, one per section of docs/BENCHMARKS.md, run as `peagle-trt bench SUITE [options]`.

The registry and the common options: peagle_trt/bench/cli.py; the harness every suite runs on (alternated
contenders, medians and spreads, the machine, the report): peagle_trt/bench/harness.py; the results file
behind BENCHMARKS.md's headline table: peagle_trt/bench/results.py; prompt sets: peagle_trt/bench/prompts.py.
"""
