"""docs/results.json, the headline figures of every suite as they stand, and the table rendered from it.

`peagle-trt bench SUITE ... --record docs/results.json` replaces SUITE's entry with this run's
headline figures (the suite's `Figure`s, bench/harness.py) and its command, machine and date;
`peagle-trt bench report` renders the opening table of docs/BENCHMARKS.md from the file (`--write`
puts it between the two marker lines there; tests/bench/test_results.py checks they agree).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from peagle_trt.bench.harness import Figure
from peagle_trt.errors import ConfigError

BEGIN, END = "<!-- results table: peagle-trt bench report --write -->", "<!-- end of results table -->"
HEADER = "| figure | value | target | machine | date | command | section |\n|---|---|---|---|---|---|---|"


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"suites": {}}


def record(path: Path, suite: str, argv: list[str], results: dict) -> None:
    """Replace `suite`'s entry of the results file at `path` with this run's figures (atomic write)."""
    if results.get("smoke"):
        raise ConfigError("--record with --smoke: a smoke run's figures mean nothing; record a real run")
    if not results.get("figures"):
        raise ConfigError(f"suite {suite} reported no headline figures to record")
    keep, skip = [], False
    for a in argv:  # the command without where its outputs went
        if skip or a.startswith(("--record", "--output-dir", "--workdir")):
            skip = not skip and "=" not in a
            continue
        keep.append(a)
    m = results["machine"]
    data = load(path)
    data["suites"][suite] = {"command": shlex.join(["peagle-trt", "bench", suite, *keep]),
                             "machine": m.get("gpu") or f"{m['cores']}-core {m['cpu']}",
                             "date": m["date"][:10], "figures": results["figures"]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)


def render(data: dict, order: list[str]) -> str:
    """The headline table: one row per figure, suites in `order` (the registry's), then any others."""
    names = [s for s in order if s in data["suites"]] + sorted(set(data["suites"]) - set(order))
    rows = []
    for suite in names:
        e = data["suites"][suite]
        for f in e["figures"]:
            value = Figure(**f).text()
            rows.append(f"| {f['name']} | **{value}** | {f.get('target') or ''} | {e['machine']} | {e['date']} | "
                        f"`{e['command']}` | [{suite}](#{suite}) |")
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
