#!/usr/bin/env bash
# Create .venv-dynamo: NVIDIA Dynamo (its frontend, KV router and worker runtime) for
# `peagle-trt dynamo` and tests/dynamo/. Usage: scripts/dynamo_env.sh [VENV_DIR]
# (default: .venv-dynamo at the repository root; gitignored). Only PyPI is needed (~80 MB).
# The venv LAYERS on the project venv (PROJECT_PYTHON, default: the python3 on PATH): a .pth file
# appends the project's site-packages after its own, so torch, transformers and peagle_trt come
# from the project and only Dynamo's packages (scripts/dynamo-requirements.txt, --no-deps) are new.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$root/.venv-dynamo}"
project_python="${PROJECT_PYTHON:-python3}"
tmp="$venv.partial"
rm -rf "$tmp"
site="$("$project_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
base="$("$project_python" -c 'import sys; print(sys._base_executable)')"
echo "[dynamo-env] 1/3 creating $venv with $("$base" -V 2>&1), layered on $site"
"$base" -m venv "$tmp"
own="$("$tmp/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import site; site.addsitedir('$site')" > "$own/zz-peagle-project.pth"
echo "[dynamo-env] 2/3 Dynamo packages (scripts/dynamo-requirements.txt, --no-deps)"
"$tmp/bin/python" -m pip install --disable-pip-version-check --no-input --progress-bar off --quiet \
    --no-deps -r "$root/scripts/dynamo-requirements.txt"
echo "[dynamo-env] 3/3 checking the imports"
"$tmp/bin/python" -c "import dynamo.frontend.main, dynamo.common.backend.worker, dynamo.llm, torch, transformers"
cp "$root/scripts/dynamo-requirements.txt" "$tmp/peagle-requirements.txt"  # stamp: what it holds
rm -rf "$venv"
mv "$tmp" "$venv"
echo "[dynamo-env] ready: $venv"
