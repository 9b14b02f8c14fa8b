"""The report of the `gpu` suite (bench/gpu.py): its markdown sections, plots, headline figures and
issue 15's target checks, from the results dict gpu.py builds (tests/bench/test_bench_gpu_smoke.py)."""

from __future__ import annotations

import argparse

from peagle_trt.bench.harness import Figure, plot, table


def _pick(rows, **want):
    return [r for r in rows if all(r.get(k) == v for k, v in want.items())]


def _one(rows, **want):
    got = _pick(rows, **want)
    return got[0] if got else None


def check_targets(res: dict) -> list[dict]:
    """Issue 15's targets, evaluated on what was measured ("n/a" when a figure is missing)."""
    kern = res.get("kernels_used")
    head = res["heads"][0]
    drafts, target, iters = res.get("drafter", []), res.get("target", []), res.get("iteration", [])
    out = []

    def add(name, value, ok, goal):
        out.append({"target": name, "goal": goal, "value": None if value is None else round(value, 3),
                    "met": None if value is None else bool(ok(value))})

    p1, p7 = (_one(drafts, head=head, kernels=kern, batch=1, k=k) for k in (1, 7))
    add("parallel draft K=7 / K=1 (batch 1)", p7 and p1 and p7["parallel_ms"] / p1["parallel_ms"],
        lambda v: v <= 1.2, "<= 1.2")
    add("sequential K=7 / parallel K=7 (batch 1)", p7 and p7["sequential_ms"] / p7["parallel_ms"],
        lambda v: v >= 4.0, ">= 4")
    v = _one(target, weights="fp8", kernels=kern, batch=1, k=7)
    add("FP8 verify K=7 batch 1: fraction of the bandwidth floor", v and v["mbu"], lambda x: x >= 0.7, ">= 0.7")
    for b, goal in ((1, 0.3), (64, 1.0)):
        it = _one(iters, mode="peagle", batch=b)
        add(f"iteration overhead, peagle, batch {b} (ms)", it and it["overhead_ms"], lambda x, g=goal: x <= g,
            f"<= {goal}")
    return out


def _table(header: list[str], rows: list[list]) -> list[str]:
    return table(header, rows).splitlines()


def _plots(res: dict, args: argparse.Namespace) -> list[str]:
    files = []
    drafts = _pick(res.get("drafter", []), head=res["heads"][0], kernels=res.get("kernels_used"))
    if drafts:
        def draw_drafter(plt):
            fig, ax = plt.subplots(figsize=(6, 4))
            for b in sorted({r["batch"] for r in drafts}):
                rs = sorted(_pick(drafts, batch=b), key=lambda r: r["k"])
                ax.plot([r["k"] for r in rs], [r["parallel_ms"] for r in rs], "o-", label=f"parallel B={b}")
                ax.plot([r["k"] for r in rs], [r["sequential_ms"] for r in rs], "s--", label=f"sequential B={b}")
            ax.set(xlabel="K (draft tokens)", ylabel="ms per drafting step", title=f"drafter {res['heads'][0]}")
            return fig

        files.append(plot(args, "drafter", draw_drafter))
    target = _pick(res.get("target", []), kernels=res.get("kernels_used"))
    if target:
        def draw_target(plt):
            fig, ax = plt.subplots(figsize=(6, 4))
            for w in sorted({r["weights"] for r in target}):
                for b in sorted({r["batch"] for r in target}):
                    rs = sorted(_pick(target, weights=w, batch=b), key=lambda r: r["k"])
                    ax.plot([r["k"] + 1 for r in rs], [r["ms"] for r in rs], "o-", label=f"{w} B={b}")
            ax.set(xlabel="rows per sequence (1 = decode, K+1 = verify)", ylabel="ms per target forward",
                   title=f"target {res['target_shape']}")
            return fig

        files.append(plot(args, "target", draw_target))
    return [f for f in files if f]


def report(res: dict, args: argparse.Namespace) -> tuple[list[str], list[Figure], dict]:
    """(the markdown sections, the headline figures, the summary keys that join the results)."""
    env, targets = res["env"], check_targets(res)
    md = [f"- device {env['device']}: {env.get('gpu', 'CPU')} (sm {env.get('sm')}), CUDA {env['cuda']}",
          f"- random weights, {res['dtype']}; target {res['target_shape']}, heads {res['heads']}, "
          f"context {res['context']} cached positions; custom ops: {res['kernel_modes']} "
          f"(Triton kernels available: {env['triton_kernels']})"]
    md += [f"- assumed shapes: {h}: {a}" for h, a in res["assumed"].items() if a]
    if res.get("copy"):
        md.append(f"- copy bandwidth (read + write) {res['copy'][0]['gb_per_s']:.0f} GB/s: the MBU reference")
    md += ["", "## Targets (issue 15)", ""]
    md += _table(["target", "goal", "measured", "met"],
                 [[t["target"], t["goal"], t["value"], {True: "yes", False: "NO", None: "n/a"}[t["met"]]]
                  for t in targets])
    md += ["", "## Drafting step: parallel (P-EAGLE, one pass) vs sequential (EAGLE-3, K passes), ms", ""]
    md += _table(["head", "ops", "batch", "K", "parallel", "sequential", "seq/par"],
                 [[r["head"], r["kernels"], r["batch"], r["k"], r["parallel_ms"], r["sequential_ms"],
                   r["sequential_ms"] / r["parallel_ms"]] for r in res.get("drafter", [])])
    md += ["", "## Target forward: decode (K=0) and verify (K+1 rows), ms and MBU", ""]
    md += _table(["weights", "ops", "batch", "K", "ms", "floor ms", "MBU"],
                 [[r["weights"], r["kernels"], r["batch"], r["k"], r["ms"], r["floor_ms"], r["mbu"]]
                  for r in res.get("target", [])])
    md += ["", "## Iteration overhead: one SpecDecoder.step minus its verify and draft forwards, ms", ""]
    md += _table(["mode", "K", "batch", "step", "verify", "draft", "overhead", "host syncs / step"],
                 [[r["mode"], r["k"], r["batch"], r["step_ms"], r["verify_ms"], r["draft_ms"], r["overhead_ms"],
                   r["host_syncs"]] for r in res.get("iteration", [])])
    syncs = sorted({s for r in res.get("iteration", []) for s in (r.get("sync_examples") or [])})
    md += [f"- sync example: `{s}`" for s in syncs]
    md += ["", f"## PROJECTION: end-to-end tokens/s (acceptance: {res.get('acceptance_source')})", ""]
    md += _table(["mode", "batch", "K", "AL", "ms / step", "tokens/s (projected)"],
                 [[r["mode"], r["batch"], r["k"], r["acceptance_length"], r["step_ms"], r["tokens_per_s"]]
                  for r in res.get("projection", [])])
    if res["skipped"] or res["errors"]:
        md += ["", "## Not measured", ""] + [f"- skipped: {s}" for s in res["skipped"]]
        md += [f"- FAILED {k}: {v}" for k, v in res["errors"].items()]
    plots = _plots(res, args)
    md += [""] + [f"![{p}]({p})" for p in plots]
    figures = [Figure(f"GPU {t['target']}", t["value"], "", t["goal"], 3) for t in targets if t["value"] is not None]
    return ["\n".join(md)], figures, {"bench_gpu": "done", "device": env.get("gpu", env["device"]),
                                       "targets": targets, "files": ["bench_gpu.json", "bench_gpu.md", *plots],
                                       "out": str(args.output_dir)}
