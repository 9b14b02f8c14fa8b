"""docs/results.json, the recorded figures of every suite as they stand, and the headline table
rendered from it.

`peagle-trt bench SUITE ... --record docs/results.json` replaces SUITE's entry with this run's
figures (the suite's `Figure`s, peagle_trt/bench/harness.py) and its command, machine and date. The
file's `headline` list picks the figures a user decides on (`[suite, figure name]` pairs, in table
order); `peagle-trt bench report` renders them as the opening table of docs/BENCHMARKS.md, each with
its target and whether the figure meets it (`--write` puts the table between the two marker lines
there; tests/bench/test_results.py checks that they agree).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from peagle_trt.bench.harness import Figure
from peagle_trt.errors import ConfigError

BEGIN, END = "<!-- results table: peagle-trt bench report --write -->", "<!-- end of results table -->"
HEADER = "| figure | value | target | met | machine | date | section |\n|---|---|---|---|---|---|---|"


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
        rows.append(f"| {f.name} | **{f.text()}** | {f.target} | {met(f)} | {entry['machine']} | {entry['date']} | "
                    f"[{suite}](#{suite}) |")
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
