#!/usr/bin/env bash
# Create the isolated virtualenv that runs the `speculators` library (the checkpoint oracle of
# tests/compat/). speculators 0.9.0 declares numpy>=2 while nvidia-pytriton needs numpy<2, so it
# cannot share the project's venv. Usage: scripts/speculators_env.sh [VENV_DIR]
# (default: .venv-speculators at the repository root; gitignored). Only PyPI is needed.
# torch==2.13.0 goes first: that exact version is a CPU wheel; letting another package pull torch
# downloads a multi-GB CUDA build. speculators itself is installed with --no-deps because it also
# declares torchvision/torchaudio, which it never imports for the models we test.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$root/.venv-speculators}"
python="${PYTHON:-python3}"
tmp="$venv.partial"
rm -rf "$tmp"
echo "[speculators-env] creating $venv with $($python -V 2>&1)"
"$python" -m venv "$tmp"
pip=("$tmp/bin/python" -m pip install --disable-pip-version-check --no-input --progress-bar off)
echo "[speculators-env] 1/3 torch==2.13.0"
"${pip[@]}" "torch==2.13.0"
echo "[speculators-env] 2/3 speculators' runtime dependencies (scripts/speculators-requirements.txt)"
"${pip[@]}" "torch==2.13.0" -r "$root/scripts/speculators-requirements.txt"
echo "[speculators-env] 3/3 speculators==0.9.0 (--no-deps)"
"${pip[@]}" --no-deps "speculators==0.9.0"
"$tmp/bin/python" -c "from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig; \
from speculators.models.eagle3 import Eagle3DraftModel"
cp "$root/scripts/speculators-requirements.txt" "$tmp/peagle-requirements.txt"  # stamp: what it holds
rm -rf "$venv"
mv "$tmp" "$venv"
echo "[speculators-env] ready: $venv"
