#!/usr/bin/env python3
"""The summary of a GPU check (scripts/gpu_validate.sh runs it after every stage): from the work folder's
stages.tsv, test logs and each benchmark stage's results JSON, it writes OUT/gpu_validate.json and
OUT/gpu_validate.md and packs the work folder into OUT/gpu_validate.tar.gz, so what a GPU lease
returns (at most 8 files of 16 MiB each) holds everything the stages made so far; prints the summary
JSON (one line).

    python scripts/gpu_validate_summary.py WORK OUT WALL_S [ARCH]

Standard library only (it runs on the GPU machine's image as it is). A log larger than MAX_MEMBER is
packed as its last MAX_MEMBER bytes, with a note. Tested by tests/bench/test_gpu_validate.py.
"""

from __future__ import annotations

import io
import json
import re
import sys
import tarfile
import time
from pathlib import Path

MAX_MEMBER = 4 << 20  # bytes of one packed file (a long test log keeps its tail)
BENCH_STAGES = {"step": "step/bench_gpu.json", "longctx": "longctx/bench_gpu.json", "peers": "peers/bench_gpu.json",
                "timing": "timing/bench_kernels.json", "seeds": "seeds/bench_seeds.json"}
BENCH_KEYS = ("smoke", "device", "commit", "wall_s", "targets", "figures", "errors", "skipped", "sections")
PEER_KEYS = ("contender", "compile", "compiled", "step_ms", "tokens_per_s", "mbu", "over_ours", "warm_s", "error")
LONG_KEYS = ("context", "part", "mode", "k", "ms", "mbu", "step_ms", "overhead_ms", "host_syncs")


def read_stages(work: Path) -> dict:
    stages = {}
    path = work / "stages.tsv"
    for line in path.read_text().splitlines() if path.is_file() else []:
        name, state, rc, secs = line.split("\t")
        stages[name] = {"state": state, "rc": int(rc), "seconds": int(secs)}
    return stages


def test_counts(work: Path) -> tuple[dict, list[str]]:
    """PASSED / FAILED / ERROR / SKIPPED from the -v lines (a timed-out run still counts what finished)."""
    counts, failed = {}, []
    for log in (work / "kernel_tests.log", work / "gpu_tests.log"):
        if log.is_file():
            text = log.read_text(errors="replace")
            for word in ("PASSED", "FAILED", "ERROR", "SKIPPED"):  # "path::test WORD"; under xdist "WORD path::test"
                n = len(re.findall(rf"::\S+ {word}", text)) + len(re.findall(rf"\] {word} \S+::", text))
                counts[word.lower()] = counts.get(word.lower(), 0) + n
            failed += re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)
    return counts, failed


def bench_summary(work: Path, rel: str) -> dict | None:
    """A benchmark stage's results (rewritten by `bench gpu` after every section, so a stage cut off
    still has what it measured), else the last line of its log (an error before any result)."""
    path = work / rel
    if path.is_file():
        try:
            res = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            return {"error": f"{rel}: unreadable ({exc})"}
        out = {k: res[k] for k in BENCH_KEYS if k in res}
        if res.get("peers"):
            out["peers"] = [{k: r.get(k) for k in PEER_KEYS} for r in res["peers"]]
        if res.get("long-context"):
            out["long_context"] = [{k: r.get(k) for k in LONG_KEYS if r.get(k) is not None}
                                   for r in res["long-context"]]
        return out
    log = path.with_suffix(".log")
    if log.is_file():
        lines = log.read_text(errors="replace").strip().splitlines()
        return {"error": (lines[-1] if lines else "no output")[:400]}
    return None


def markdown(summary: dict) -> str:
    md = ["# GPU check", "", f"wall {summary['wall_s']} s, commit {summary['commit']}, cubins for sm_{summary['arch']}a"
          if summary["arch"] else f"wall {summary['wall_s']} s, commit {summary['commit']}", "",
          "| stage | state | rc | s |", "|---|---|---|---|"]
    md += [f"| {k} | {v['state']} | {v['rc']} | {v['seconds']} |" for k, v in summary["stages"].items()]
    if summary["tests"]:
        md += ["", f"tests: {summary['tests']}", *[f"- FAILED {t}" for t in summary["failed_tests"]]]
    for stage, bench in summary["bench"].items():
        md += ["", f"## {stage}", ""]
        if bench.get("error"):
            md.append(f"- error: {bench['error']}")
        for t in (t for t in bench.get("targets", []) if t["value"] is not None):
            md.append(f"- {t['target']}: {t['value']} (goal {t['goal']}, met: {t['met']})")
        if not bench.get("targets"):  # a suite without targets (bench kernels): its headline figures
            md += [f"- {f['name']}: {f['value']} (target {f.get('target') or '-'})" for f in bench.get("figures", [])]
        for r in bench.get("long_context", []):
            ms = r.get("ms", r.get("step_ms"))
            md.append(f"- context {r['context']}, {r['part']} {r['mode']}: {ms:.3f} ms"
                      + (f", MBU {r['mbu']:.2f}" if r.get("mbu") is not None else "")
                      + (f", host syncs {r['host_syncs']}" if r.get("host_syncs") is not None else ""))
        for p in bench.get("peers", []):
            md.append(f"- peer {p['contender']}: {p['step_ms']} ms/token, MBU {p['mbu']}, x ours {p['over_ours']}"
                      + (f", ERROR {p['error']}" if p.get("error") else ""))
        md += [f"- FAILED section {k}: {v}" for k, v in bench.get("errors", {}).items()]
        md += [f"- skipped: {s}" for s in bench.get("skipped", [])]
    return "\n".join(md) + "\n"


def pack(work: Path, out: Path) -> list[str]:
    """Every file of the work folder into out/gpu_validate.tar.gz (tails of the large ones)."""
    names = []
    tmp = out / "gpu_validate.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for path in sorted(p for p in work.rglob("*") if p.is_file() and p.name != "summary.line"):
            rel = path.relative_to(work).as_posix()
            data = path.read_bytes()
            if len(data) > MAX_MEMBER:
                cut = len(data) - MAX_MEMBER
                data = b"[gpu_validate_summary: the first %d bytes cut]\n" % cut + data[-MAX_MEMBER:]
            info = tarfile.TarInfo(rel)
            info.size, info.mtime = len(data), int(path.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
            names.append(rel)
    tmp.replace(out / "gpu_validate.tar.gz")
    return names


def main(argv: list[str]) -> int:
    work, out, wall = Path(argv[0]), Path(argv[1]), int(argv[2])
    arch = argv[3] if len(argv) > 3 else ""
    out.mkdir(parents=True, exist_ok=True)
    stages = read_stages(work)
    counts, failed = test_counts(work)
    bench = {s: b for s, rel in BENCH_STAGES.items() if s in stages and (b := bench_summary(work, rel))}
    env = (work / "env.txt").read_text(errors="replace") if (work / "env.txt").is_file() else ""
    commit = re.search(r"^commit (\S+)", env, re.M)
    ok = (all(v["state"] in ("ok", "missing") for k, v in stages.items()
              if k != "build" or "build_no_werror" not in stages)
          and not failed and counts.get("failed", 0) == 0)
    summary = {"gpu_validate": "done", "ok": ok, "wall_s": wall, "arch": arch, "commit": commit and commit.group(1),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "stages": stages, "tests": counts,
               "failed_tests": failed[:40], "bench": bench, "out": str(out), "work": str(work)}
    (out / "gpu_validate.md").write_text(markdown(summary))
    summary["packed"] = len(pack(work, out))
    (out / "gpu_validate.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
