"""The output contract of the benchmark suites (peagle_trt/bench/cli.py): markdown and plots.

`markdown_table(header, rows)` formats one table; `emit(args, text)` prints a suite's markdown report
to stdout and writes it to OUTPUT_DIR/bench_SUITE.md; `save_plot(args, suffix, draw)` draws one PNG
with matplotlib (imported here, lazily) into OUTPUT_DIR and only warns when that fails. The JSON
results are written by peagle_trt/bench/cli.py and printed last by peagle_trt/cli.py.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def markdown_table(header: list[str], rows: list[list], digits: int = 3) -> str:
    """A markdown table; floats get `digits` decimals, None an empty cell."""

    def cell(x) -> str:
        if isinstance(x, float):
            return f"{x:.{digits}f}"
        return "" if x is None else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows])


def _stem(args: argparse.Namespace) -> str:
    return "bench_" + getattr(args, "suite", "suite").replace("-", "_")


def emit(args: argparse.Namespace, text: str) -> Path | None:
    """Print the markdown report to stdout; with --output-dir also write OUTPUT_DIR/bench_SUITE.md."""
    print(text.rstrip() + "\n", flush=True)
    if getattr(args, "output_dir", None) is None:
        return None
    path = Path(args.output_dir) / f"{_stem(args)}.md"
    path.write_text(text.rstrip() + "\n")
    return path


def save_plot(args: argparse.Namespace, suffix: str, draw: Callable) -> str | None:
    """`draw(plt)` makes one figure; it is saved as OUTPUT_DIR/bench_SUITE[_suffix].png. Returns the
    file name, or None (no --output-dir, matplotlib missing, or drawing failed: a warning on stderr)."""
    if getattr(args, "output_dir", None) is None:
        return None
    name = f"{_stem(args)}{'_' + suffix if suffix else ''}.png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = draw(plt)
        fig.savefig(Path(args.output_dir) / name, dpi=110)
        plt.close(fig)
    except Exception as exc:  # a plot is optional: warn, never abort the run
        print(f"[bench] warning: plot {name} not written ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None
    return name
