#!/usr/bin/env bash
# The GPU training run of SmolLM2's heads, one script for every call of a remote GPU lease; the plan
# of calls and the limits it is sized for: scripts/gpu_transfer.py's docstring; the recipe and its
# knobs (the flags of `train`): peagle_trt/train/gpu_recipe.py.
#
#   scripts/gpu_train.sh prepare [--part-mib N]   here: GGUF parts in .gpu-part-K/, gguf in .gpu-site/,
#                                                 the plan of device calls (JSON, last stdout line)
#   scripts/gpu_train.sh parts                    there, calls 1..N-1 (carry [.gpu-part-K]): parts present
#   scripts/gpu_train.sh train [RECIPE FLAGS]     there, call N (carry [.gpu-part-N, .gpu-site]): reassemble +
#                                                 sha256, convert, train P-EAGLE and EAGLE-3 online, pack into $OUT
#   scripts/gpu_train.sh back                     there, right after train when its summary's back.left is not
#                                                 empty (no carry): the next parts of the heads into $OUT
#   scripts/gpu_train.sh collect DIR.. [--dest D] here: reassemble + sha256, load, held-out curve on 222 answers
#
# Knobs: PEAGLE_PYTHON (default: python3 there, .venv/bin/python here if present). The log of `train`
# is tee'd into $OUT/train.log (it comes back with the heads); progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
cmd="${1:?usage: scripts/gpu_train.sh prepare|parts|train|back|collect [args]}"; shift
if [[ -n "${PEAGLE_PYTHON:-}" ]]; then PY="$PEAGLE_PYTHON"
elif [[ "$cmd" != parts && "$cmd" != train && "$cmd" != back && -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# there: the carried gguf (.gpu-site holds only gguf, which the GPU image lacks); here the venv's is used
if [[ "$cmd" == train && -d "$REPO/.gpu-site" ]]; then export PYTHONPATH="$PYTHONPATH:$REPO/.gpu-site"; fi
case "$cmd" in
  train)
    OUT_DIR="${OUT:-$REPO/gpu_results}"; mkdir -p "$OUT_DIR"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >&2 || true
    "$PY" scripts/gpu_transfer.py train --out "$OUT_DIR" "$@" 2> >(tee "$OUT_DIR/train.log" >&2)
    ;;
  back) "$PY" scripts/gpu_transfer.py back --out "${OUT:-$REPO/gpu_results}" "$@" ;;
  prepare|parts|collect) "$PY" scripts/gpu_transfer.py "$cmd" "$@" ;;
  *) echo "scripts/gpu_train.sh: unknown command $cmd (prepare, parts, train, back, collect)" >&2; exit 2 ;;
esac
