#!/usr/bin/env bash
# `peagle-trt bench aiperf` with AIPerf in its own venv: makes .venv-bench (aiperf==0.13.0; gitignored,
# aiperf's pins conflict with ours) on first use, then runs the suite with it. Every argument goes to
# the suite (peagle-trt bench aiperf --help; docs/BENCHMARKS.md, "OpenAI endpoint: AIPerf sweep").
# Needs .venv with `pip install -e '.[dev]'`.
#
#   scripts/bench_aiperf.sh --output-dir docs/img                            # ~16 min on 2 busy cores
#   scripts/bench_aiperf.sh --ks 3 --concurrency 1,4 --duration 5            # a quick look
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH=.venv-bench
if [ ! -x "$BENCH/bin/aiperf" ]; then
    echo "creating $BENCH (aiperf) ..." >&2
    python3 -m venv "$BENCH"
    "$BENCH/bin/python" -m pip install -q aiperf==0.13.0
fi
exec .venv/bin/python -m peagle_trt.cli bench aiperf --aiperf "$BENCH/bin/aiperf" "$@"
