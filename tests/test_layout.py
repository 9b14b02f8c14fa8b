"""The layout rules that do not check themselves otherwise: every `__init__.py` only re-exports
(at most 40 lines, no function or class of its own), and no two subpackages of peagle_trt import
each other, function-level imports included (the floors are monotonic)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "peagle_trt"


def _unit(path: Path) -> str:
    """The subpackage (or top-level module) a file belongs to."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _imports() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        src = _unit(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + ([f"{node.module}.{a.name}" for a in node.names]
                                         if node.module == "peagle_trt" else [])
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                match = re.match(r"peagle_trt\.(\w+)", name)
                if match and match.group(1) != src:
                    edges.setdefault(src, set()).add(match.group(1))
    return edges


def test_init_files_only_re_export():
    for path in PACKAGE.rglob("__init__.py"):
        text = path.read_text()
        assert len(text.splitlines()) <= 40, f"{path}: more than 40 lines; move the logic into a module"
        tree = ast.parse(text, str(path))
        for node in tree.body:
            assert isinstance(node, (ast.Expr, ast.Import, ast.ImportFrom, ast.Assign)), \
                f"{path}:{node.lineno}: an __init__.py holds re-exports only"
            if isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                assert names in (["__all__"], ["__version__"]), \
                    f"{path}:{node.lineno}: only __all__ (and __version__) may be assigned in an __init__.py"


def test_no_two_subpackages_import_each_other():
    edges = _imports()
    crossing = {frozenset({a, b}) for a, targets in edges.items() for b in targets
                if a in edges.get(b, set())}
    assert not crossing, f"subpackages importing each other: {crossing}"


def test_the_speculative_core_sits_below_the_scheduler_and_the_executors():
    edges = _imports()
    assert not edges.get("speculative", set()) & {"runtime", "executors", "serving"}
    assert not edges.get("models", set()) & {"checkpoint"}
    assert edges.get("runtime", set()) <= {"config", "errors", "speculative"}


def test_ops_is_the_lowest_floor():
    """ops/ owns the op names, domain and plugin identity; it imports nothing above it."""
    assert _imports().get("ops", set()) <= {"errors"}


def test_every_verb_lives_in_the_folder_of_its_name():
    """`peagle-trt VERB` is parsed and handled by peagle_trt/<verb>/cli.py (`make-tiny`: make_tiny/), whose
    `add_parser(sub)` the root cli.py only registers."""
    import argparse

    from peagle_trt.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert len(sub.choices) >= 13
    for verb, parser in sub.choices.items():
        module = f"peagle_trt.{verb.replace('-', '_')}.cli"
        handlers = [parser.get_default("func")] + [p.get_default("func") for a in parser._actions
                                                   if isinstance(a, argparse._SubParsersAction)
                                                   for p in a.choices.values()]
        for func in filter(None, handlers):
            assert func.__module__ == module, f"`peagle-trt {verb}` is handled in {func.__module__}, not {module}"
        assert (PACKAGE / verb.replace("-", "_") / "cli.py").is_file(), verb
    root = ast.parse((PACKAGE / "cli.py").read_text())
    extra = {n.name for n in root.body if isinstance(n, ast.FunctionDef)} - {"build_parser", "main",
                                                                              "quiet_third_party_progress"}
    assert not extra, f"the root cli.py only registers the verbs; move {extra} to the verb's folder"
