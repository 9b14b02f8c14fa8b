"""Benchmark suites, run as `python -m peagle_trt.bench.SUITE` (decode: decode.py)."""
