"""House habits that check themselves, in the default suite (so `.ci/run` stays the README's test
command): ruff passes with the project's configuration (pyproject.toml, [tool.ruff]), and every
repository path named in code, docstrings and docs exists. The layout rules are in
tests/test_layout.py."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = ("peagle_trt", "tests", "scripts", "docs", "plugins", "model_repo", "docker", ".ci")
# a path token: one of the top folders, a slash, path characters (placeholders like <...>, {...} and
# globs are no repository paths and are skipped)
TOPS = "|".join(re.escape(t) for t in TOP)
PATH_RE = re.compile(r"(?<![\w./=-])((?:" + TOPS + r")/[\w./*<>{}-]*[\w/*>}])")
# outputs that builds and runs create: named in docs, absent from a clean checkout
GENERATED = ("plugins/build", "plugins/sm_")
TEXT = {".py", ".md", ".toml", ".sh", ".tmpl", ".txt", ".pbtxt", ".cpp", ".h", ".cu", ".cuh", ""}


def tracked_texts() -> list[tuple[Path, str]]:
    """(path, text) of every tracked text file (the shipped assets aside)."""
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    texts = []
    for name in out.splitlines():
        f = ROOT / name
        if f.suffix in TEXT and f.is_file() and "assets" not in Path(name).parts[:2]:
            try:
                texts.append((f, f.read_text()))
            except UnicodeDecodeError:
                continue
    return texts


def exists(path: str, where: Path) -> bool:
    """`path` names a file or folder of the repository (or, in a file's own folder tree listing,
    of that folder); `tests/helpers.PAIRS`-style dotted references count when the module exists."""
    if (ROOT / path).exists() or (where / path).exists():
        return True
    module, _, _attr = path.rpartition(".")
    return bool(module) and (ROOT / f"{module}.py").exists()


def test_every_named_repository_path_exists():
    missing = []
    for f, text in tracked_texts():
        for m in PATH_RE.finditer(text):
            path = m.group(1).rstrip(".")
            if any(c in path for c in "*<>{}") or path.startswith(GENERATED) or exists(path, f.parent):
                continue
            missing.append(f"{f.relative_to(ROOT)}: {path}")
    assert not missing, "paths named in the repository that do not exist:\n" + "\n".join(sorted(set(missing)))


def test_ruff_passes_with_the_project_configuration():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: it is part of the [dev] extra (pip install -c constraints.txt -e '.[dev]')")
    res = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


DOTTED_RE = re.compile(r"(?<![\w.])peagle_trt(?:\.\w+)+")


def resolves(dotted: str) -> bool:
    """`peagle_trt.<module>.<name>`: the longest prefix is a module or package of the repository and the
    rest, if any, starts with a name that module's source defines or imports."""
    parts = dotted.split(".")
    if parts[:2] == ["peagle_trt", "model_repo"]:  # the templates folder, installed under this name
        parts = parts[1:]
    if parts[:2] == ["peagle_trt", "triton"]:  # a logger's name, not a module
        return True
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file():
            rest = parts[i:]
            return not rest or re.search(rf"\b{re.escape(rest[0])}\b", source.read_text()) is not None
    return False


def test_every_named_module_and_name_exists():
    missing = []
    for f, text in tracked_texts():
        missing += [f"{f.relative_to(ROOT)}: {m.group(0)}" for m in DOTTED_RE.finditer(text)
                    if not resolves(m.group(0).rstrip("."))]
    assert not missing, "dotted names that do not exist:\n" + "\n".join(sorted(set(missing)))
