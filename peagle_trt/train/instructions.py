"""Instruction prompts made offline from the installed Python standard library: the requests a
target answers for self-distillation (scripts/make_smollm2_heads.py) and the held-out instruction
set of the benchmarks (`peagle-trt bench heads`).

    rows = instructions("train", seed=0)     # [{"id", "kind", "prompt", "max_tokens"}, ...]
    rows = instructions("heldout", seed=0)   # other modules: never trained on
    files = source_files(400_000)             # training-split module sources, ~400K tokens (teacher-forced)
    rows = instructions("train", source="packages")  # the same, from installed third-party packages
    files = source_files(400_000, source="packages")

Kinds (each row is one user turn; the target's chat template is applied by the caller):
  write      "Write a Python function `sig` that <first docstring line>."   code
  complete   a function's def line and docstring, "complete the body"       code
  explain    a function's source, "explain what it does"                    prose
  docstring  a function's source without its docstring, "write one"          prose + code
  module     "What is the `name` module for? Show a short example."          prose + code
  summarize  a docstring paragraph, "summarize in two sentences"            prose
  long       a whole module's source (2K-6K characters... up to ~2.5K tokens), "summarize it"
             (long context; answers are ordinary)
  essay      "Write a complete, documented module that <module docstring>"  long answers
Sources: "stdlib" (the installed standard library) or "packages" (PACKAGES: installed pure-Python
third-party packages, pinned by constraints.txt; more functions to write and complete once the
standard library's are all answered).
Split by module: a module belongs to `heldout` when the crc32 of its dotted name is 0 mod 10, so
the held-out set shares no function, docstring or module with the training set. HumanEval is never
a source here (it is test data).
Tests: tests/train/test_instructions.py.
"""

from __future__ import annotations

import ast
import copy
import random
import sysconfig
import zlib
from pathlib import Path

SPLITS = ("train", "heldout")
MAX_TOKENS = {"write": 256, "complete": 256, "explain": 256, "docstring": 200, "module": 256,
              "summarize": 128, "long": 256, "essay": 1200}


SOURCES = ("stdlib", "packages")
PACKAGES = ("numpy", "sympy", "networkx", "jinja2", "click", "requests", "rich", "pygments", "packaging",
            "jsonschema", "markdown_it", "httpx", "attr", "dateutil", "fsspec", "pyparsing", "huggingface_hub",
            "setuptools", "pip", "yaml", "tqdm", "typer", "mpmath", "matplotlib", "scipy")


def stdlib_modules() -> list[tuple[str, Path]]:
    """(dotted name, path) of the standard library's Python modules (tests, site-packages, private
    and __main__ modules excluded), sorted by name."""
    return _modules(Path(sysconfig.get_paths()["stdlib"]))


def package_modules() -> list[tuple[str, Path]]:
    """(dotted name, path) of the installed PACKAGES' Python modules (those not installed are
    skipped; the same exclusions as the standard library's), sorted by name."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    return sorted(m for pkg in PACKAGES if (purelib / pkg).is_dir() for m in _modules(purelib, purelib / pkg))


def source_modules(source: str) -> list[tuple[str, Path]]:
    """(dotted name, path) of one of SOURCES' modules; a clear ValueError for any other name."""
    if source not in SOURCES:
        raise ValueError(f"source {source!r}: expected one of {SOURCES}")
    return stdlib_modules() if source == "stdlib" else package_modules()


def _modules(root: Path, under: Path | None = None) -> list[tuple[str, Path]]:
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "turtledemo"}
    out = []
    for path in (under or root).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        if skip & set(parts) or any(p.startswith("_") and p != "__init__" for p in parts) or "__main__" in parts:
            continue
        name = ".".join(p for p in parts if p != "__init__")
        if name:
            out.append((name, path))
    return sorted(out)


def split_of(module: str) -> str:
    return "heldout" if zlib.crc32(module.encode()) % 10 == 0 else "train"


def _first_sentence(doc: str) -> str:
    line = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    return " ".join(line.split())


def _functions(tree: ast.Module):
    """Public module-level functions and methods with a docstring and a body beyond it, of 4-41
    lines (counted from the node's positions: `ast.get_source_segment` re-splits the whole file on
    every call, which made a split's instructions cost a minute)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and len(node.body) > 1:
            doc = ast.get_docstring(node)
            if doc and 3 <= node.end_lineno - node.lineno <= 40:
                yield node, doc


def _signature(node: ast.FunctionDef) -> str:
    args = ast.unparse(node.args)
    ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"{node.name}({args}){ret}"


def _with_body(node: ast.FunctionDef, body: list) -> str:
    """The function's source (decorators dropped) with another body."""
    new = copy.copy(node)
    new.body, new.decorator_list = body, []
    return ast.unparse(new)


def _module_rows(name: str, path: Path, rng: random.Random) -> list[dict]:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
        return []
    rows = []
    mdoc = ast.get_docstring(tree)
    if mdoc and len(_first_sentence(mdoc)) >= 20:
        first = _first_sentence(mdoc)[:300]
        rows.append(("module", f"What is Python's `{name}` module for? ({first}) "
                               "Explain briefly and show a short example."))
        if rng.random() < 0.25 and not name.startswith("encodings."):
            rows.append(("essay", f"Write a complete, well-documented Python module that does the following: "
                                  f"{first} Include several classes and functions with docstrings, type "
                                  "hints, and a small test section at the end."))
    if 2000 <= len(source) <= 9000 and rng.random() < 0.5:
        rows.append(("long", f"Here is the Python module `{name}`:\n\n```python\n{source.strip()}\n```\n\n"
                             "Summarize what this module does and list its main functions."))
    for node, doc in _functions(tree):
        first = _first_sentence(doc)
        if not 15 <= len(first) <= 300:
            continue
        r = rng.random()
        if r < 0.35:
            rows.append(("write", f"Write a Python function `{_signature(node)}` that does the following: "
                                  f"{first}"))
        elif r < 0.55:
            head = _with_body(node, node.body[:1])
            rows.append(("complete", f"Complete the body of this Python function:\n\n```python\n{head}\n```"))
        elif r < 0.75:
            rows.append(("explain", "Explain what this Python function does:\n\n"
                                    f"```python\n{_with_body(node, node.body)}\n```"))
        elif r < 0.9:
            rows.append(("docstring", "Write a docstring for this Python function and show the function "
                                      f"with it:\n\n```python\n{_with_body(node, node.body[1:])}\n```"))
        elif "\n\n" in doc.strip() or len(doc) > 200:
            rows.append(("summarize", f"Summarize this documentation in two sentences:\n\n{doc.strip()}"))
    return [{"id": f"{name}:{i}", "kind": kind, "prompt": text, "max_tokens": MAX_TOKENS[kind]}
            for i, (kind, text) in enumerate(rows)]


def instructions(split: str = "train", seed: int = 0, limit: int | None = None,
                 source: str = "stdlib") -> list[dict]:
    """The rows of one split of one source, shuffled with `seed` (the same seed gives the same list)."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: expected one of {SPLITS}")
    rows = []
    for name, path in source_modules(source):
        if split_of(name) == split:
            rows += _module_rows(name, path, random.Random(f"{seed}:{name}"))
    random.Random(seed).shuffle(rows)
    return rows[:limit] if limit is not None else rows


def source_files(approx_tokens: int, seed: int = 0, min_bytes: int = 2000, source: str = "stdlib") -> list[Path]:
    """Training-split module sources of one source (files of at least `min_bytes`, shuffled with
    `seed`) until about `approx_tokens` tokens (3.2 bytes a token): real Python for `train --text`
    beside the answers, from the same modules as the training instructions."""
    mods = [(name, path) for name, path in source_modules(source) if split_of(name) == "train"]
    random.Random(seed).shuffle(mods)
    files, tokens = [], 0.0
    for _, path in mods:
        if tokens > approx_tokens:
            break
        size = path.stat().st_size
        if size >= min_bytes:
            files.append(path)
            tokens += size / 3.2
    return files
