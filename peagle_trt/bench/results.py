"""docs/results.json, the recorded figures of every suite as they stand, and the headline table
rendered from it.

`peagle-trt bench SUITE ... --record docs/results.json` replaces SUITE's entry with this run's
figures (the suite's `Figure`s, peagle_trt/bench/harness.py) and its command, machine, date and the
commit measured (when the run knows it: `source_commit`). A run made elsewhere (a GPU machine, whose
copy of the tree has no git history) is recorded from its saved JSON here: `peagle-trt bench report
--record-run OUT/bench_SUITE.json --commit SHA` (`record_run`; a suite whose module has `refigure(results)`,
as peagle_trt/bench/gpu.py, re-derives its figures from the saved rows). The file's
`headline` list picks the figures a user decides on (`[suite, figure name]` pairs, in table order);
`peagle-trt bench report` renders them as the opening table of docs/BENCHMARKS.md, each with its
target, whether the figure meets it and the commit measured (`--write` puts the table between the two
marker lines there; tests/bench/test_results.py checks that they agree).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import subprocess
from dataclasses import asdict
from pathlib import Path

from peagle_trt.bench.harness import Figure
from peagle_trt.errors import ConfigError

BEGIN, END = "<!-- results table: peagle-trt bench report --write -->", "<!-- end of results table -->"
HEADER = ("| figure | value | target | met | machine | date | commit | section |\n"
          "|---|---|---|---|---|---|---|---|")


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"suites": {}}


def source_commit(repo: Path | None = None) -> str | None:
    """The commit a run measures: PEAGLE_COMMIT (set where the tree travelled without its history, as
    scripts/gpu_validate.sh passes it), else `git rev-parse HEAD` of the checkout holding this package,
    with "+dirty" when tracked files differ from it; None when neither is known."""
    if os.environ.get("PEAGLE_COMMIT"):
        return os.environ["PEAGLE_COMMIT"]
    repo = repo or Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
    except OSError:  # no git on this machine
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def command_of(suite: str, argv: list[str]) -> str:
    """The command that reproduces a run: `peagle-trt bench SUITE` and its options, without where its
    outputs went."""
    keep, skip = [], False
    for a in argv:
        if skip or a.startswith(("--record", "--output-dir", "--workdir")):
            skip = not skip and "=" not in a
            continue
        keep.append(a)
    return shlex.join(["peagle-trt", "bench", suite, *keep])


def record(path: Path, suite: str, argv: list[str], results: dict, commit: str | None = None) -> None:
    """Replace `suite`'s entry of the results file at `path` with this run's figures (atomic write);
    `commit`: the commit measured, else the run's own `commit` when it recorded one."""
    if results.get("smoke"):
        raise ConfigError("--record with --smoke: a smoke run's figures mean nothing; record a real run")
    if not results.get("figures"):
        raise ConfigError(f"suite {suite} reported no headline figures to record")
    m = results["machine"]
    data = load(path)
    entry = {"command": command_of(suite, argv), "machine": m.get("gpu") or f"{m['cores']}-core {m['cpu']}",
             "date": m["date"][:10], "figures": results["figures"]}
    commit = commit or results.get("commit")
    if commit:
        entry["commit"] = commit
    data["suites"][suite] = entry
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)


def record_run(path: Path, run_json: Path, commit: str | None = None, argv: list[str] | None = None) -> dict:
    """Record a saved run (OUTPUT_DIR/bench_SUITE.json, e.g. brought back from a GPU machine) into the
    results file at `path`: its suite from its options, its figures re-derived where the suite can
    (`refigure(results)`: the current targets over the rows it measured), its command from its argv
    (or `argv`), `commit` (or the run's own). Returns the entry."""
    results = json.loads(Path(run_json).read_text())
    suite = (results.get("options") or {}).get("suite")
    if not suite:
        raise ConfigError(f"{run_json}: no options.suite: not a `peagle-trt bench` results file")
    from peagle_trt.bench.cli import SUITES

    module = importlib.import_module(f"peagle_trt.bench.{SUITES[suite][0]}")
    if hasattr(module, "refigure"):
        results["figures"] = [asdict(f) for f in module.refigure(results)]
    argv = argv if argv is not None else results.get("argv")
    if argv is None:
        raise ConfigError(f"{run_json} does not hold the command's options (an older run): pass --argv '...'")
    record(path, suite, argv, results, commit)
    return load(path)["suites"][suite]


def met(figure: Figure) -> str:
    """Whether the figure, as the table shows it, meets its target (`>= 1.6x`, `<= 0.3 ms`): "met",
    "**missed**", or "" where it has none."""
    bound = re.fullmatch(r"(>=|<=)\s*([\d.]+)\s*\S*", figure.target.strip())
    if not bound:
        return ""
    value, limit = round(figure.value, figure.digits), float(bound.group(2))
    return "met" if (value >= limit if bound.group(1) == ">=" else value <= limit) else "**missed**"


def render(data: dict) -> str:
    """The headline table: one row per `[suite, figure name]` of the file's `headline` list."""
    rows = []
    for suite, name in data.get("headline", []):
        entry = data["suites"].get(suite)
        found = [f for f in (entry or {}).get("figures", []) if f["name"] == name]
        if not found:
            raise ConfigError(f"the headline of the results file names {name!r} of suite {suite!r}, which its "
                              "recorded figures lack (a new run renamed it?): update the `headline` list")
        f = Figure(**found[0])
        commit = (entry.get("commit") or "")[:7] + ("+dirty" if "+dirty" in entry.get("commit", "") else "")
        rows.append(f"| {f.name} | **{f.text()}** | {f.target} | {met(f)} | {entry['machine']} | {entry['date']} | "
                    f"{commit} | [{suite}](#{suite}) |")
    return "\n".join([HEADER, *rows])


def block(text: str) -> str:
    """The table between the marker lines of a BENCHMARKS.md text ('' when the markers are missing)."""
    if BEGIN not in text or END not in text:
        return ""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def write(doc: Path, table: str) -> None:
    """Put `table` between the marker lines of `doc`."""
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise ConfigError(f"{doc} has no results table markers ({BEGIN} ... {END})")
    head, rest = text.split(BEGIN, 1)
    doc.write_text(f"{head}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}")
