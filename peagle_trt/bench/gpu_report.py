"""What `bench gpu` (peagle_trt/bench/gpu.py) makes of its measured rows: the PROJECTION of end-to-end
tokens/s from published acceptance lengths, the targets checked on what was measured (`check_targets`:
a figure that was not measured is None, never guessed), and the markdown report with its plots.

Targets (an H200, ratios in one run): a batch-1 decode with CUDA graphs at MBU >= 0.7 and no slower
than gpt-fast's, ahead of transformers' compiled static-cache `generate`; one host sync per step on
CUDA; iteration overhead <= 0.3 ms at batch 1 and <= 1.0 ms at batch 64; P-EAGLE's drafting at K = 7
within 1.2x of K = 1; FP8 verify at 70% of its bandwidth floor. Tested through the smoke run:
tests/bench/test_bench_gpu_smoke.py.
"""

from __future__ import annotations

from peagle_trt.bench.harness import Figure, lines, records, series

# Acceptance lengths of the projection: PUBLISHED, not measured here
PUBLISHED_AL = {"peagle": {3: 2.87, 7: 3.70}, "eagle3": {3: 2.70, 7: 3.27}}
AL_SOURCE = "published: vLLM/AWS P-EAGLE blog, GPT-OSS-20B MT-Bench (not measured here)"
MBU_TARGET = "decode batch 1 with CUDA graphs: MBU"  # the headline's name (after "GPU ")


def section_projection(res: dict) -> list[dict]:
    """tokens/s = B * AL / (t_verify + t_draft + overhead); none: B / (t_decode + overhead); AL published."""
    al = PUBLISHED_AL
    kern, graphs = res["kernels_used"], res.get("graphs_used", False)
    verify = {(r["batch"], r["k"]): r["ms"] for r in res.get("target", [])
              if r["weights"] == "bf16" and r["kernels"] == kern and r.get("graphs", False) == graphs}
    drafts = {(r["batch"], r["k"]): r for r in res.get("drafter", [])  # the target's own head
              if r["head"] == res["heads"][-1] and r["kernels"] == kern}
    rows = []
    for it in res.get("iteration", []):
        if it.get("graphs", False) != graphs:
            continue
        mode, b = it["mode"], it["batch"]
        for k in [0] if mode == "none" else sorted(al.get(mode, {})):
            if (b, k) not in verify or (mode != "none" and (b, k) not in drafts):
                continue
            draft = 0.0 if mode == "none" else drafts[(b, k)]["parallel_ms" if mode == "peagle" else "sequential_ms"]
            length = 1.0 if mode == "none" else al[mode][k]
            step = verify[(b, k)] + draft + it["overhead_ms"]
            rows.append({"mode": mode, "batch": b, "k": k, "acceptance_length": length, "step_ms": step,
                         "tokens_per_s": b * length / step * 1e3, "label": "PROJECTION"})
    return rows


def _one(res: dict, rows: str, **want) -> dict | None:
    return next((r for r in res.get(rows, []) if all(r.get(k) == v for k, v in want.items())), None)


def check_targets(res: dict) -> list[dict]:
    """The targets on what was measured: (target, goal, value, met, digits); value None when the
    figure is missing (its section skipped, failed, or a peer that could not run)."""
    kern, head, graphs = res["kernels_used"], res["heads"][0], res.get("graphs_used", False)
    p1, p7 = (_one(res, "drafter", head=head, kernels=kern, batch=1, k=k) for k in (1, 7))
    fp8 = _one(res, "target", weights="fp8", kernels=kern, batch=1, k=7)
    decode = _one(res, "target", weights="bf16", kernels=kern, graphs=graphs, batch=1, k=0)
    it1, it64 = (_one(res, "iteration", mode="peagle", batch=b, graphs=graphs) for b in (1, 64))
    peers = {r["contender"]: r for r in res.get("peers", []) if r.get("step_ms")}
    ours = peers.get("peagle-trt")

    def over(peer: str) -> float | None:
        return ours["step_ms"] / peers[peer]["step_ms"] if ours and peer in peers else None
    checks = [("parallel draft K=7 / K=1 (batch 1)", p7 and p1 and p7["parallel_ms"] / p1["parallel_ms"], "<=", 1.2, 3),
              ("sequential K=7 / parallel K=7 (batch 1)", p7 and p7["seq_over_par"], ">=", 4.0, 3),
              ("FP8 verify K=7 batch 1: fraction of the bandwidth floor", fp8 and fp8["mbu"], ">=", 0.7, 3),
              (MBU_TARGET if graphs else "decode batch 1: MBU", decode and decode["mbu"], ">=", 0.7, 2),
              ("host syncs per step, peagle, batch 1", it1 and it1.get("host_syncs"), "<=", 1, 0),
              ("iteration overhead, peagle, batch 1 (ms)", it1 and it1["overhead_ms"], "<=", 0.3, 3),
              ("iteration overhead, peagle, batch 64 (ms)", it64 and it64["overhead_ms"], "<=", 1.0, 3),
              ("decode step batch 1, ours / gpt-fast", over("gpt-fast"), "<=", 1.0, 2),
              ("decode step batch 1, ours / transformers (compiled static cache)", over("transformers"), "<", 1.0, 2)]
    out = []
    for name, v, op, goal, digits in checks:
        met = None if v is None else {"<=": v <= goal, ">=": v >= goal, "<": v < goal}[op]
        out.append({"target": name, "goal": f"{op} {goal}", "value": None if v is None else round(v, 3),
                    "met": met, "digits": digits})
    return out


def figures(res: dict) -> list[Figure]:
    """The suite's headline figures (docs/results.json): the targets that were measured."""
    return [Figure(f"GPU {t['target']}", t["value"], "", t["goal"], t.get("digits", 3))
            for t in res["targets"] if t["value"] is not None]


def report(res: dict, a) -> list[str]:
    env, kern = res["env"], res["kernels_used"]
    out = [f"device {env['device']}: {env.get('gpu', 'CPU')} (sm {env.get('sm')}), CUDA {env['cuda']}; random "
           f"weights, {res['dtype']}; target {res['target_shape']}, heads {res['heads']}, context {res['context']}; "
           f"custom ops: {res['kernel_modes']}; sections {res['sections']}; commit {res.get('commit')}; "
           f"assumed: {[v for v in res['assumed'].values() if v]}",
           "### Targets", records(res["targets"], ["target", "goal", "value", "met"]),
           "### Drafting step, parallel (one pass) vs sequential (K passes), ms",
           records(res.get("drafter", []), ["head", "kernels", "batch", "k", "parallel_ms", "sequential_ms",
                                            "seq_over_par"]),
           "### Target forward: decode (k = 0) and verify (k + 1 rows), ms and MBU",
           records(res.get("target", []), ["weights", "kernels", "graphs", "batch", "k", "ms", "floor_ms", "mbu"]),
           "### Iteration overhead: one SpecDecoder.step minus its verify and draft forwards, ms",
           records(res.get("iteration", []), ["mode", "graphs", "k", "batch", "step_ms", "verify_ms", "draft_ms",
                                              "overhead_ms", "host_syncs", "sync_examples"]),
           f"### Batch-1 decode beside the peers (alternated, context {res['context']}; MBU: the same bytes per "
           "step over the copy bandwidth; over_ours: step time / ours)",
           records(res.get("peers", []), ["contender", "compile", "compiled", "step_ms", "tokens_per_s", "mbu",
                                          "over_ours", "warm_s", "error"]),
           "### Long contexts, batch 1 (the attention split over the context on the kernels): forwards and steps",
           records(res.get("long-context", []), ["context", "part", "mode", "k", "kernels", "graphs", "ms", "mbu",
                                                 "step_ms", "overhead_ms", "host_syncs"]),
           "### Profiles (torch.profiler): kernels by device time, host ops by self time, us",
           records(res.get("profile", []), ["what", "kind", "name", "calls", "us"]),
           f"### PROJECTION: end-to-end tokens/s (acceptance: {AL_SOURCE})",
           records(res.get("projection", []), ["mode", "batch", "k", "acceptance_length", "step_ms", "tokens_per_s"]),
           "\n".join([f"- skipped: {s}" for s in res["skipped"]] + [f"- FAILED {k}: {v}" for k, v in
                                                                     res["errors"].items()])]
    drafts = [r for r in res.get("drafter", []) if r["head"] == res["heads"][0] and r["kernels"] == kern]
    drafting = {**series(drafts, "k", "parallel_ms", lambda r: f"parallel B={r['batch']}"),
                **series(drafts, "k", "sequential_ms", lambda r: f"sequential B={r['batch']}")}
    forwards = series([r for r in res.get("target", []) if r["kernels"] == kern], lambda r: r["k"] + 1, "ms",
                      lambda r: f"{r['weights']}{' graphs' if r.get('graphs') else ''} B={r['batch']}")
    plots = [(f"drafter {res['heads'][0]}", "K (draft tokens)", "ms per drafting step", drafting),
             (res["target_shape"], "rows per sequence (1 = decode)", "ms per target forward", forwards)]
    plots = [p for p in plots if p[-1]]
    return out + ([lines(a, "", plots)] if plots else [])
