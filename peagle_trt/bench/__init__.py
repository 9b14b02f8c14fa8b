"""Benchmark suites, one per section of docs/BENCHMARKS.md, run as `peagle-trt bench SUITE [options]`: the
registry in peagle_trt/bench/cli.py, the harness every suite runs on in peagle_trt/bench/harness.py."""
