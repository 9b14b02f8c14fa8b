#!/usr/bin/env bash
# The GPU check in one script, for a bare H100/H200 with a CUDA build of torch and triton (no network,
# no TensorRT, peagle-trt not installed: the checkout is put on PYTHONPATH):
#
#   scripts/gpu_validate.sh [OUT_DIR]        # default: $OUT if set, else ./gpu_results
#
# It measures the step, the long-context rows, the MoE targets, two peers and the kernels; everything a
# stage writes goes to a work folder (GPU_VALIDATE_WORK, default a fresh /tmp/gpu_validate.XXXXXX) that
# is packed after EVERY stage into OUT_DIR as three files (a GPU lease returns at most 8 files of 16 MiB):
#   gpu_validate.json   stage states, seconds, test counts, each benchmark's targets, peers and errors
#   gpu_validate.md     the same for reading
#   gpu_validate.tar.gz every stage's log and results (bench_gpu.json/.md/.png per stage, ...)
# so a stage that fails or a call cut off at its limit still returns what the stages before it made.
# The LAST stdout line is the JSON summary; exit status 0 only when every stage run succeeded (a
# missing `bench seeds` suite is reported as "missing", not a failure).
#
# Stages (GPU_VALIDATE_STAGES, comma-separated, run in this order; default env,step,longctx,seeds,peers,timing),
# each with its cap in seconds (GPU_VALIDATE_CAP_<STAGE> changes it):
#   env      20 s   nvidia-smi, nvcc, torch / CUDA / triton / transformers versions, the commit  -> env.txt
#   step     100 s  bench gpu --sections copy,drafter,target,fp8,iteration,profile,projection --kernel-modes cuda:
#                   host syncs per step on CUDA, iteration overhead at batch 1 and 64, decode/verify MBU with
#                   CUDA graphs off and on, the profile rows, FP8, the projection       -> step/bench_gpu.*
#   longctx  50 s   bench gpu --sections copy,long-context: decode, verify and the step at 8K and 32K context
#                   (the attention split over the context)                              -> longctx/bench_gpu.*
#   seeds    240 s  python -m peagle_trt.cli bench seeds (the MoE targets at real shapes; GPU_VALIDATE_SEEDS_ARGS),
#                   run only where the suite exists, else recorded "missing"           -> seeds/bench_seeds.*
#   peers    165 s  bench gpu --sections copy,peers --gpt-fast DIR: our batch-1 decode beside transformers'
#                   compiled static-cache generate and gpt-fast's (torch.compile reduce-overhead), alternated;
#                   a peer whose set-up would start past the stage's budget is a row with that error
#                                                                                       -> peers/bench_gpu.*
#   timing   90 s   bench kernels --smoke (GPU_VALIDATE_KERNELS_ARGS): the kernels' sweep against the roofline
#                                                                                       -> timing/bench_kernels.*
#   build, kernels, tests (not in the default): the plugin build (scripts/build_plugins.sh, this GPU's arch),
#                   the interpreter's kernel tests compiled for this GPU, every GPU-marked test
#                                                               -> build.log, kernel_tests.log, gpu_tests.log/.xml
# A stage runs under min(its cap, budget left - 20 s); one that fails or times out is recorded and the
# next still runs; one with under 10 s left is recorded "skipped".
#
# The check in a 15-minute lease: TWO calls of the device tool of at most 250 s each, so that the
# machine's start (1-2 minutes), both calls and a rerun of either fit (120 + 3 x 250 s < 900 s). Here,
# first (the GPU machine has no network, and the tree travels without its git history): a gpt-fast
# checkout in .gpt-fast (ignored by .gitignore; never committed), e.g. from the session's `fetch` tool
# (github:pytorch-labs/gpt-fast, then `git --git-dir=<its git dir> worktree add .gpt-fast` or an archive of
# its HEAD), and `git rev-parse HEAD` here: the commit measured, SHA below.
# then, with the SHA written into each command:
#   run(command="PEAGLE_COMMIT=SHA GPU_VALIDATE_STAGES=env,step,longctx,seeds GPU_VALIDATE_BUDGET_S=230 "
#               "bash scripts/gpu_validate.sh", timeout_s=250)
#   run(command="PEAGLE_COMMIT=SHA GPU_VALIDATE_STAGES=env,peers,timing GPU_VALIDATE_BUDGET_S=230 "
#               "bash scripts/gpu_validate.sh", carry=[".gpt-fast"], timeout_s=250)
# (the first call: step 100 + longctx 50 + seeds with what is left, ~55 s; the second: peers 165 + timing
# with what is left, ~40 s). Back here: extract each call's gpu_validate.tar.gz into
# docs/gpu_runs/<date>/call<n>/, record the runs (`peagle-trt bench report --record-run
# docs/gpu_runs/<date>/call1/step/bench_gpu.json --commit SHA`, the same for the kernels' and seeds' runs),
# then `peagle-trt bench report --write`.
#
# Knobs: PEAGLE_PYTHON (python3), PEAGLE_COMMIT (else git HEAD where the checkout has its history),
# GPU_VALIDATE_BUDGET_S (540), GPU_VALIDATE_STAGES, GPU_VALIDATE_CAP_<STAGE>, GPU_VALIDATE_WORK,
# GPU_VALIDATE_GPT_FAST (the gpt-fast checkout, default .gpt-fast), GPU_VALIDATE_STEP_ARGS / _LONGCTX_ARGS /
# _PEERS_ARGS / _KERNELS_ARGS / _SEEDS_ARGS (replace a stage's default options), GPU_VALIDATE_SEEDS_SUITE
# (seeds), GPU_VALIDATE_WORKERS (8: the GPU tests' xdist workers), GPU_VALIDATE_REHEARSE=1 (the CPU
# rehearsal: tiny shapes, --smoke, the kernels under Triton's interpreter; tests/bench/test_gpu_validate.py).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
OUT_DIR="$(mkdir -p "${1:-${OUT:-gpu_results}}" && cd "${1:-${OUT:-gpu_results}}" && pwd)"
PY="${PEAGLE_PYTHON:-python3}"
BUDGET="${GPU_VALIDATE_BUDGET_S:-540}"
REHEARSE="${GPU_VALIDATE_REHEARSE:-0}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
if [[ -z "${PEAGLE_COMMIT:-}" ]] && git -C "$REPO" rev-parse HEAD >/dev/null 2>&1; then  # a checkout here
    PEAGLE_COMMIT="$(git -C "$REPO" rev-parse HEAD)$(git -C "$REPO" diff --quiet HEAD -- 2>/dev/null || echo +dirty)"
fi
export PEAGLE_COMMIT="${PEAGLE_COMMIT:-}"
WORK="${GPU_VALIDATE_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_validate.XXXXXX")}"
mkdir -p "$WORK"
BUILD_DIR="$(mkdir -p "${PEAGLE_PLUGINS_BUILD_DIR:-plugins/build}" && cd "${PEAGLE_PLUGINS_BUILD_DIR:-plugins/build}" && pwd)"
export PEAGLE_PLUGINS_BUILD_DIR="$BUILD_DIR"
STATUS_FILE="$WORK/stages.tsv"
: > "$STATUS_FILE"
START=$SECONDS
STAGES=",${GPU_VALIDATE_STAGES:-env,step,longctx,seeds,peers,timing},"
SMOKE=(); [[ "$REHEARSE" == 1 ]] && SMOKE=(--smoke)

left() { echo $(( BUDGET - (SECONDS - START) )); }
cap() { local v="GPU_VALIDATE_CAP_${1^^}"; echo "${!v:-$2}"; }  # a stage's cap in seconds (knob or default)
wanted() { [[ "$STAGES" == *",$1,"* ]]; }
summarize() {  # the summary and the pack into OUT_DIR: after every stage
    "$PY" scripts/gpu_validate_summary.py "$WORK" "$OUT_DIR" "$(( SECONDS - START ))" "${ARCH:-}" > "$WORK/summary.line" \
        2> "$WORK/summary.err" || echo "[gpu_validate] summary failed: $(tail -3 "$WORK/summary.err")" >&2
}
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$STATUS_FILE"; }

# run_stage NAME CAP_S LOG CMD...: runs CMD under min(CAP, budget left - reserve), records rc and seconds
run_stage() {
    local name=$1 cap=$2 log=$3; shift 3
    local reserve=20 limit
    wanted "${name%_no_werror}" || return 0
    limit=$(( $(left) - reserve ))
    (( limit > cap )) && limit=$cap
    if (( limit < 10 )); then
        record "$name" skipped 0 0
        echo "[gpu_validate] $name: skipped (budget spent)" >&2
        summarize
        return 0
    fi
    echo "[gpu_validate] $name (limit ${limit}s) ..." >&2
    mkdir -p "$(dirname "$log")"
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    rc=$?
    local state=ok
    (( rc == 124 || rc == 137 )) && state=timeout
    (( rc != 0 && rc != 124 && rc != 137 )) && state=failed
    record "$name" "$state" "$rc" "$(( SECONDS - t0 ))"
    echo "[gpu_validate] $name: $state (rc $rc, $(( SECONDS - t0 ))s)" >&2
    summarize
    return 0
}

# -- env -------------------------------------------------------------------------------------------------
env_report() {
    date -u +"%Y-%m-%d %H:%M UTC"; uptime
    echo "commit ${PEAGLE_COMMIT:-unknown}"
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1
    nvcc --version 2>&1 | tail -1; cmake --version 2>&1 | head -1
    "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1
    "$PY" -c "import transformers; print('transformers', transformers.__version__)" 2>&1
    "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', \
torch.version.cuda, 'device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
}
run_stage env "$(cap env 20)" "$WORK/env.txt" bash -c "$(declare -f env_report); PY='$PY' env_report"

CAP="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')"
case "$CAP" in
    90|100) ARCH="$CAP" ;;
    *) ARCH="90" ;;  # no cubin runs elsewhere: build Hopper's to check the build itself
esac

# -- the step: syncs, overhead, MBU with graphs, profile rows (the Triton kernels' path: the product's) --------
STEP_DEFAULT="--sections copy,drafter,target,fp8,iteration,profile,projection"
[[ "$REHEARSE" == 1 ]] || STEP_DEFAULT="$STEP_DEFAULT --kernel-modes cuda"
read -ra STEP_ARGS <<< "${GPU_VALIDATE_STEP_ARGS:-$STEP_DEFAULT}"
bench_budget() {  # bench gpu's --budget-s inside a stage of cap $1: sections (or peers) starting later are skipped
    local b=$(( $(left) - 20 )); (( b > $1 )) && b=$1; b=$(( b - 30 )); (( b < 15 )) && b=15; echo "$b"
}
run_stage step "$(cap step 100)" "$WORK/step/bench_gpu.log" "$PY" -m peagle_trt.cli bench gpu "${SMOKE[@]}" \
    --output-dir "$WORK/step" --budget-s "$(bench_budget "$(cap step 100)")" "${STEP_ARGS[@]}"

# -- long contexts: 8K and 32K --------------------------------------------------------------------------------
read -ra LONG_ARGS <<< "${GPU_VALIDATE_LONGCTX_ARGS:---sections copy,long-context}"
run_stage longctx "$(cap longctx 50)" "$WORK/longctx/bench_gpu.log" "$PY" -m peagle_trt.cli bench gpu "${SMOKE[@]}" \
    --output-dir "$WORK/longctx" "${LONG_ARGS[@]}"

# -- the MoE targets' seeds table (a suite of its own; reported missing where this checkout lacks it) ---------
SEEDS_SUITE="${GPU_VALIDATE_SEEDS_SUITE:-seeds}"
if wanted seeds; then
    if "$PY" -c "import sys; from peagle_trt.bench.cli import SUITES; sys.exit('$SEEDS_SUITE' not in SUITES)" \
        > "$WORK/seeds_check.log" 2>&1; then
        # on the GPU: the two published targets P-EAGLE's headline figures are on, at concurrency 1 and 8, the
        # table and the verify cost curve; --budget-s skips a section that would start too late (each section's
        # rows are written as it ends, so a stage cut short keeps what it measured)
        SEEDS_GPU="--targets qwen3-coder-30b-a3b,gpt-oss-20b --concurrency 1,8 --sections table,curve --rounds 2"
        SEEDS_LIMIT=$(( $(left) - 20 )); (( SEEDS_LIMIT > $(cap seeds 240) )) && SEEDS_LIMIT=$(cap seeds 240)
        SEEDS_GPU="$SEEDS_GPU --steps 6 --budget-s $(( SEEDS_LIMIT > 60 ? SEEDS_LIMIT - 30 : SEEDS_LIMIT / 2 ))"
        if [ -n "${SMOKE[*]}" ]; then SEEDS_GPU="${SMOKE[*]}"; fi
        read -ra SEEDS_ARGS <<< "${GPU_VALIDATE_SEEDS_ARGS:-$SEEDS_GPU}"
        run_stage seeds "$(cap seeds 240)" "$WORK/seeds/bench_seeds.log" "$PY" -m peagle_trt.cli bench "$SEEDS_SUITE" \
            --output-dir "$WORK/seeds" "${SEEDS_ARGS[@]}"
    else
        record seeds missing 0 0
        echo "[gpu_validate] seeds: missing (this checkout has no 'bench $SEEDS_SUITE' suite)" >&2
        summarize
    fi
fi

# -- the peers: transformers and gpt-fast beside our decode ----------------------------------------------------
GPT_FAST="${GPU_VALIDATE_GPT_FAST:-.gpt-fast}"  # a missing checkout is a peer row with its error, not a skip
read -ra PEER_ARGS <<< "${GPU_VALIDATE_PEERS_ARGS:---sections copy,peers}"
run_stage peers "$(cap peers 165)" "$WORK/peers/bench_gpu.log" "$PY" -m peagle_trt.cli bench gpu "${SMOKE[@]}" \
    --output-dir "$WORK/peers" --budget-s "$(bench_budget "$(cap peers 165)")" --gpt-fast "$GPT_FAST" "${PEER_ARGS[@]}"

# -- the kernels' sweep against the roofline ---------------------------------------------------------------
KDEFAULT="--smoke"; [[ "$REHEARSE" == 1 ]] && KDEFAULT="--smoke --rehearse"
read -ra KERNEL_ARGS <<< "${GPU_VALIDATE_KERNELS_ARGS:-$KDEFAULT}"
run_stage timing "$(cap timing 90)" "$WORK/timing/bench_kernels.log" "$PY" -m peagle_trt.cli bench kernels \
    --output-dir "$WORK/timing" "${KERNEL_ARGS[@]}"

# -- optional: the plugin build, the kernel tests on this GPU, the GPU tests -------------------------------------
run_stage build 240 "$WORK/build.log" env PEAGLE_TRITON_ARCHS="$ARCH" PEAGLE_PYTHON="$PY" bash scripts/build_plugins.sh
if wanted build && ! grep -q $'^build\tok' "$STATUS_FILE"; then  # e.g. a warning of this machine's host compiler
    run_stage build_no_werror 180 "$WORK/build_no_werror.log" \
        env PEAGLE_TRITON_ARCHS="$ARCH" PEAGLE_PYTHON="$PY" PEAGLE_WERROR=OFF bash scripts/build_plugins.sh
fi
run_stage kernels 240 "$WORK/kernel_tests.log" env PEAGLE_TRITON_DEVICE=cuda "$PY" -m pytest -m kernels -v -rfE \
    -p no:cacheprovider tests/ops/test_triton_kernels.py tests/ops/test_kv_attention_split.py tests/ops/test_fp8_linear.py \
    tests/ops/test_norm_rope.py
if wanted tests; then
    mapfile -t GPU_TESTS < <(grep -rl "pytest.mark.gpu" tests --include='test_*.py' | sort)
    TEST_ARGS=(--durations=30)
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then  # stop a hung test (its stack is printed), then the stage
        session=$(( $(left) - 45 )); (( session > 255 )) && session=255
        # thread method: a test stuck inside a C call (a CUDA sync) never runs a signal handler
        TEST_ARGS+=(--timeout=120 --timeout-method=thread --session-timeout="$session")
    fi
    if "$PY" -c "import xdist" 2>/dev/null; then TEST_ARGS+=(-n "${GPU_VALIDATE_WORKERS:-8}"); fi
    run_stage tests 270 "$WORK/gpu_tests.log" "$PY" -m pytest -m gpu -v -rfE -p no:cacheprovider \
        --junitxml="$WORK/gpu_tests.xml" "${TEST_ARGS[@]}" "${GPU_TESTS[@]}"
fi

# -- summary: gpu_validate.{json,md,tar.gz} in OUT_DIR; the JSON is the last stdout line --------------------------
summarize
echo "[gpu_validate] work folder $WORK; results in $OUT_DIR" >&2
cat "$WORK/summary.line"
"$PY" -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['ok'] else 1)" "$OUT_DIR/gpu_validate.json"
