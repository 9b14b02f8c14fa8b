"""Suite `curves` (docs/BENCHMARKS.md, "curves"): training recipes at equal training CPU time, from the
learning curves `peagle-trt train` writes (curve.jsonl beside each head: per evaluation step,
train_cpu_s, loss, top1 per position, chain_accepted_k7), named by `--heads [LABEL=]DIR ...`; nothing is
trained here. Every recipe at common CPU-time marks (fractions of the shortest run, interpolated) and at
its own end; --smoke reads two synthetic curves (figures meaningless).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from peagle_trt.bench.harness import Figure, finish, lines, records
from peagle_trt.errors import ConfigError

KEYS = ("step", "train_cpu_s", "loss", "top1", "chain_accepted_k7")
MARKS = (0.25, 0.5, 0.75, 1.0)  # fractions of the shortest run's CPU time
GETTERS = {"step": lambda r: r["step"], "loss": lambda r: r["loss"], "top1_pos1": lambda r: r["top1"][0],
           "chain_accepted_k7": lambda r: r["chain_accepted_k7"]}  # the figures of a row, interpolated


def read_curve(path: Path) -> list[dict]:
    """The evaluations of one curve.jsonl (a head directory or the file), in CPU-time order."""
    path = path / "curve.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"no learning curve at {path} (peagle-trt train writes curve.jsonl beside the head)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    missing = {k for r in rows for k in KEYS if k not in r}
    if not rows or missing:
        raise ConfigError(f"{path}: {'no evaluations' if not rows else f'rows without {sorted(missing)}'}")
    return sorted(rows, key=lambda r: r["train_cpu_s"])


def at(rows: list[dict], cpu_s: float) -> dict | None:
    """step, loss, position-1 top-1 and chain proxy at `cpu_s` CPU seconds, linearly interpolated
    between the evaluations around it (a warm start's rows continue its head's: peagle_trt/train/curve.py
    `continued`); None outside the curve (never extrapolated)."""
    for a, b in zip(rows, rows[1:] or rows):
        if a["train_cpu_s"] <= cpu_s <= b["train_cpu_s"]:
            w = (cpu_s - a["train_cpu_s"]) / ((b["train_cpu_s"] - a["train_cpu_s"]) or 1.0)
            return {key: mix(get(a), get(b), w) for key, get in GETTERS.items()}
    return None


def mix(x: float | None, y: float | None, w: float) -> float | None:
    """(1 - w) x + w y; a side without a value (a run's first row has no loss yet) gives the other's."""
    return y if x is None else x if y is None else (1 - w) * x + w * y


def synthetic_curves(root: Path) -> list[str]:
    """--smoke: two made-up curves (a fast and a slow recipe), labelled as such."""
    for name, rate in (("smoke-fast", 2.0), ("smoke-slow", 1.0)):
        (root / name).mkdir()
        rows = [{"step": 100 * i, "train_cpu_s": 60.0 * i, "wall_s": 40.0 * i, "supervised_seen": 800 * i,
                 "loss": 5.0 / (1 + rate * i), "top1": [0.6 * i * rate / (1 + i * rate), 0.3 * i / (1 + i)],
                 "chain_accepted_k7": 1 + 2 * i * rate / (1 + i * rate)} for i in range(1, 6 if rate > 1 else 8)]
        (root / name / "curve.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [f"{name}={root / name}" for name in ("smoke-fast", "smoke-slow")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heads", nargs="+", default=[], metavar="[LABEL=]DIR",
                   help="trained head directories (or curve.jsonl files), each optionally labelled")


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-curves-smoke-") as tmp:
        if args.smoke:
            args.heads = synthetic_curves(Path(tmp))
        if not args.heads:
            raise ConfigError("pass --heads [LABEL=]DIR ... (heads trained by peagle-trt train, with curve.jsonl)")
        specs = [h.split("=", 1) if "=" in h else (Path(h).name, h) for h in args.heads]
        curves = {label: read_curve(Path(path)) for label, path in specs}
    shortest = min(rows[-1]["train_cpu_s"] for rows in curves.values())
    marks = [round(f * shortest) for f in MARKS]
    rows = [{"recipe": label, "at": f"{f:.0%} of the shortest", "cpu_s": s, **(at(curve, s) or {})}
            for f, s in zip(MARKS, marks) for label, curve in curves.items()]
    rows += [{"recipe": label, "at": "final", "cpu_s": c[-1]["train_cpu_s"],
              **{key: get(c[-1]) for key, get in GETTERS.items()}} for label, c in curves.items()]
    best = max(curves, key=lambda label: curves[label][-1]["chain_accepted_k7"])
    final = curves[best][-1]

    plot_name = lines(args, "", [(title, "training CPU hours", label, {
        name: ([r["train_cpu_s"] / 3600 for r in c], [get(r) for r in c]) for name, c in curves.items()})
        for title, label, get in (("Position-1 top-1", "held-out top-1, position 1", GETTERS["top1_pos1"]),
                                  ("Chain proxy (K=7)", "chain_accepted_k7", GETTERS["chain_accepted_k7"]))])
    figures = [Figure(f"training curves, best recipe ({best}): final position-1 top-1", final["top1"][0], "", "", 3),
               Figure(f"training curves, best recipe ({best}): final chain_accepted_k7",
                      final["chain_accepted_k7"], "")]
    return finish(args, f"Training curves at equal CPU time ({len(curves)} recipes"
                  f"{', SMOKE: synthetic curves' if args.smoke else ''})",
                  [records([{**r, "cpu_h": r["cpu_s"] / 3600} for r in rows],
                           ["recipe", "at", "cpu_h", "step", "loss", "top1_pos1", "chain_accepted_k7"]),
                   plot_name],
                  {"recipes": {label: {"path": path, "evaluations": len(curves[label]), "final": curves[label][-1]}
                               for label, path in specs},
                   "marks_cpu_s": marks, "best": best, "rows": rows}, figures)
