#!/usr/bin/env bash
# GPU validation in ONE command, for a bare H100/H200 with a CUDA build of torch and triton (cmake or
# g++, pytest; no network, no TensorRT, peagle-trt not installed: the checkout is put on PYTHONPATH):
#
#   scripts/gpu_validate.sh [OUT_DIR]        # default: $OUT if set, else ./gpu_results
#
# Stages, each under its own time limit inside a 9-minute budget (a failing or timed-out stage is
# recorded and the next one still runs; results are rewritten after every stage):
#   1 env     nvidia-smi, nvcc, torch / CUDA versions                          -> env.txt
#   2 build   scripts/build_plugins.sh: the Triton kernels compiled ahead of time for this GPU's
#             architecture only (cubins, resource checks), the launcher, warnings as errors
#             (retried with PEAGLE_WERROR=OFF if only -Werror stops it)          -> build.log
#   3 kernels the interpreter's kernel tests (tests/ops/test_triton_kernels.py, test_kv_attention_split.py,
#             test_fp8_linear.py, test_norm_rope.py) on the GPU: the same cases, compiled by Triton for this GPU
#             (PEAGLE_TRITON_DEVICE=cuda)                                        -> kernel_tests.log
#   4 tests   every GPU-marked test: the kernels against their CPU references at full sizes and the
#             torch executor (token identity, every spec mode and target family, bf16/fp32/FP8,
#             both op backends, CUDA graphs on by default), CUDA graph replay = eager at the same
#             bucket (tests/executors/test_cuda_graphs.py)                       -> gpu_tests.log, gpu_tests.xml
#   5 timing  peagle-trt bench kernels: each kernel's time and bandwidth against the HBM roofline
#                                                                                -> bench_kernels.log
#   6 bench   peagle-trt bench gpu (python -m peagle_trt.cli): bf16 forwards and the step's iteration
#             with CUDA graphs off and on in the one run (rows "graphs": false / true)
#                                                                                -> bench_gpu.{json,md,*.png}
# Then gpu_validate.json + gpu_validate.md (stage status, seconds, test counts, benchmark targets),
# and the LAST stdout line is the JSON summary; exit status 0 only when every stage run and test passed.
# Nothing is shipped prebuilt: the kernels are built here. The GPU tests run under pytest-xdist where
# it is installed (GPU_VALIDATE_WORKERS processes share the GPU: the tests are host-bound), each under
# a per-test timeout (a hang prints its stack and the run goes on) and a session timeout that ends the
# stage with its report; the 30 slowest tests are listed.
# Knobs: PEAGLE_PYTHON (default python3), GPU_VALIDATE_BUDGET_S (default 540), GPU_VALIDATE_STAGES
# (default env,build,kernels,tests,timing,bench: rerun a subset on a short lease), GPU_VALIDATE_WORKERS
# (default 8).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
OUT_DIR="$(mkdir -p "${1:-${OUT:-gpu_results}}" && cd "${1:-${OUT:-gpu_results}}" && pwd)"
PY="${PEAGLE_PYTHON:-python3}"
BUDGET="${GPU_VALIDATE_BUDGET_S:-540}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1
BUILD_DIR="$(mkdir -p "${PEAGLE_PLUGINS_BUILD_DIR:-plugins/build}" && cd "${PEAGLE_PLUGINS_BUILD_DIR:-plugins/build}" && pwd)"
export PEAGLE_PLUGINS_BUILD_DIR="$BUILD_DIR"
STATUS_FILE="$OUT_DIR/stages.tsv"
: > "$STATUS_FILE"
START=$SECONDS

STAGES=",${GPU_VALIDATE_STAGES:-env,build,kernels,tests,timing,bench},"

left() { echo $(( BUDGET - (SECONDS - START) )); }
wanted() { [[ "$STAGES" == *",$1,"* ]]; }

# run_stage NAME CAP_S LOG CMD...: runs CMD under min(CAP, budget left - reserve), records rc and seconds
run_stage() {
    local name=$1 cap=$2 log=$3; shift 3
    local reserve=20 limit
    wanted "${name%_no_werror}" || return 0
    limit=$(( $(left) - reserve ))
    (( limit > cap )) && limit=$cap
    if (( limit < 10 )); then
        printf '%s\tskipped\t0\t0\n' "$name" >> "$STATUS_FILE"
        echo "[gpu_validate] $name: skipped (budget spent)" >&2
        return 0
    fi
    echo "[gpu_validate] $name (limit ${limit}s) ..." >&2
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    rc=$?
    local state=ok
    (( rc == 124 || rc == 137 )) && state=timeout
    (( rc != 0 && rc != 124 && rc != 137 )) && state=failed
    printf '%s\t%s\t%s\t%s\n' "$name" "$state" "$rc" "$(( SECONDS - t0 ))" >> "$STATUS_FILE"
    echo "[gpu_validate] $name: $state (rc $rc, $(( SECONDS - t0 ))s)" >&2
    return 0
}

# -- 1 env ---------------------------------------------------------------------------------------------
env_report() {
    date -u +"%Y-%m-%d %H:%M UTC"; uptime
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1
    cmake --version 2>&1 | head -1; "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1
    "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', \
torch.version.cuda, 'device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
}
run_stage env 60 "$OUT_DIR/env.txt" bash -c "$(declare -f env_report); PY='$PY' env_report"

# -- 2 build (this GPU's arch only: a third of the full build's time) --------------------------------------
CAP="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')"
case "$CAP" in
    90|100) ARCH="$CAP" ;;
    *) ARCH="90" ;;  # no cubin runs elsewhere: build Hopper's to check the build itself
esac
run_stage build 240 "$OUT_DIR/build.log" env PEAGLE_TRITON_ARCHS="$ARCH" PEAGLE_PYTHON="$PY" bash scripts/build_plugins.sh
if wanted build && ! grep -q $'^build\tok' "$STATUS_FILE"; then  # e.g. a warning of this machine's host compiler
    run_stage build_no_werror 180 "$OUT_DIR/build_no_werror.log" \
        env PEAGLE_TRITON_ARCHS="$ARCH" PEAGLE_PYTHON="$PY" PEAGLE_WERROR=OFF bash scripts/build_plugins.sh
fi

# -- 3 the interpreter's kernel tests, on the GPU ---------------------------------------------------------
run_stage kernels 240 "$OUT_DIR/kernel_tests.log" env PEAGLE_TRITON_DEVICE=cuda "$PY" -m pytest -m kernels -v -rfE \
    -p no:cacheprovider tests/ops/test_triton_kernels.py tests/ops/test_kv_attention_split.py tests/ops/test_fp8_linear.py \
    tests/ops/test_norm_rope.py

# -- 4 GPU tests ------------------------------------------------------------------------------------------
mapfile -t GPU_TESTS < <(grep -rl "pytest.mark.gpu" tests --include='test_*.py' | sort)
TEST_ARGS=(--durations=30)
if "$PY" -c "import pytest_timeout" 2>/dev/null; then  # stop a hung test (its stack is printed), then the stage
    session=$(( $(left) - 45 )); (( session > 255 )) && session=255
    # thread method: a test stuck inside a C call (a CUDA sync) never runs a signal handler
    TEST_ARGS+=(--timeout=120 --timeout-method=thread --session-timeout="$session")
fi
if "$PY" -c "import xdist" 2>/dev/null; then TEST_ARGS+=(-n "${GPU_VALIDATE_WORKERS:-8}"); fi
run_stage tests 270 "$OUT_DIR/gpu_tests.log" "$PY" -m pytest -m gpu -v -rfE -p no:cacheprovider \
    --junitxml="$OUT_DIR/gpu_tests.xml" "${TEST_ARGS[@]}" "${GPU_TESTS[@]}"

# -- 5 kernel timing against the roofline ----------------------------------------------------------------
run_stage timing 150 "$OUT_DIR/bench_kernels.log" "$PY" -m peagle_trt.cli bench kernels --smoke

# -- 6 benchmark ------------------------------------------------------------------------------------------
BENCH_BUDGET=$(( $(left) - 90 ))
(( BENCH_BUDGET < 30 )) && BENCH_BUDGET=30
run_stage bench 300 "$OUT_DIR/bench_gpu.log" "$PY" -m peagle_trt.cli bench gpu --output-dir "$OUT_DIR" \
    --budget-s "$BENCH_BUDGET"

# -- summary ----------------------------------------------------------------------------------------------
"$PY" - "$OUT_DIR" "$ARCH" "$(( SECONDS - START ))" <<'EOF'
import json, re, sys
from pathlib import Path

out, arch, wall = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
stages = {}
for line in (out / "stages.tsv").read_text().splitlines():
    name, state, rc, secs = line.split("\t")
    stages[name] = {"state": state, "rc": int(rc), "seconds": int(secs)}
counts, failed = {}, []
for log in (out / "kernel_tests.log", out / "gpu_tests.log"):
    if log.is_file():  # from the -v lines, so a timed-out run still counts what finished
        text = log.read_text(errors="replace")
        for word in ("PASSED", "FAILED", "ERROR", "SKIPPED"):  # "path::test WORD" or, under xdist, "WORD path::test"
            n = len(re.findall(rf"::\S+ {word}", text)) + len(re.findall(rf"\] {word} \S+::", text))
            counts[word.lower()] = counts.get(word.lower(), 0) + n
        failed += re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)
bench = {}
if (out / "bench_gpu.log").is_file():
    lines = (out / "bench_gpu.log").read_text(errors="replace").strip().splitlines()
    try:
        bench = json.loads(lines[-1]) if lines else {}  # the suite's results: keep the summary keys
        bench = {k: bench[k] for k in ("bench_gpu", "smoke", "device", "wall_s", "targets", "errors",
                                         "skipped", "files", "out", "error") if k in bench}
    except json.JSONDecodeError:
        bench = {"error": lines[-1][:300] if lines else "no output"}
summary = {"gpu_validate": "done", "wall_s": wall, "arch": arch, "stages": stages, "tests": counts,
           "failed_tests": failed[:40], "bench": bench, "out": str(out)}
(out / "gpu_validate.json").write_text(json.dumps(summary, indent=1))
md = ["# GPU validation", "", f"wall {wall} s, Triton cubins built for sm_{arch}a", "", "| stage | state | rc | s |",
      "|---|---|---|---|"]
md += [f"| {k} | {v['state']} | {v['rc']} | {v['seconds']} |" for k, v in stages.items()]
md += ["", f"GPU tests: {counts}", *[f"- FAILED {t}" for t in failed[:40]], "",
       "Benchmark: see bench_gpu.md" if (out / "bench_gpu.md").is_file() else "Benchmark: no report"]
for t in bench.get("targets", []):
    md.append(f"- {t['target']}: {t['value']} (goal {t['goal']}, met: {t['met']})")
(out / "gpu_validate.md").write_text("\n".join(md) + "\n")
print(json.dumps(summary))
ok = all(v["state"] == "ok" for k, v in stages.items() if k != "build" or "build_no_werror" not in stages)
sys.exit(0 if ok and not failed and counts.get("failed", 0) == 0 else 1)
EOF
