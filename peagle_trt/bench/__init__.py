"""Benchmark suites, one per section of docs/BENCHMARKS.md, run as `peagle-trt bench SUITE [options]`: the
registry in bench/cli.py, the harness every suite runs on in bench/harness.py."""
