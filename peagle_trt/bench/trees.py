"""Suite `trees` (docs/BENCHMARKS.md, "trees"): P-EAGLE draft trees vs chains (docs/SERVING.md, "Draft
trees") in process (peagle_trt/bench/measure.py), greedy, raw HumanEval prompts, every request --max-tokens long:
none, chains of each K in --ks, trees of each budget in --budgets (depth: the largest K) and the
adaptive budget (peagle_trt/speculative/tree_size.py), alternated per batch; per cell AL and tok/s (also over
the longest chain), draft nodes per step, request-steps by budget (0: the chain), mismatches with
none, and the depth at which the accepted path left the top-1 chain.
"""

from __future__ import annotations

import argparse
import contextlib
from collections import Counter
from pathlib import Path
from unittest import mock

from peagle_trt.bench.harness import Figure, finish, int_list, lines, options, series, table

SMOKE = dict(prompts=2, max_tokens=8, rounds=1, budgets="8", batch="1,2")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", type=Path, default=None, help="P-EAGLE head (default: TARGET/drafter-peagle)")
    p.add_argument("--ks", default="4,7", help="comma-separated chain lengths K (trees: depth = the largest)")
    p.add_argument("--budgets", default="8,16,32", help="comma-separated tree budgets B (draft nodes per step)")
    options(p, target="code-pair", batch="1,8", prompts=8, max_tokens=96, rounds=5, backend="onnxruntime")


def watching(left: Counter, nodes: Counter):
    """(around(name) for pair.measure, the patch of the step's `TargetAcceptor.accept`): during
    `name`'s passes, per step and request the draft nodes (nodes[name, "nodes"], nodes[name,
    "steps"]), its budget (nodes[name, "budget", b]; 0: a chain) and the depth at which the accepted
    path left the top-1 chain (left[name, depth]; a node's first child in the tree is its top-1).
    It reads the verdict back to the host: a measurement's own cost, outside the product step."""
    from peagle_trt.speculative.accept import TargetAcceptor
    from peagle_trt.speculative.tree import chain

    running, accept = [None], TargetAcceptor.accept

    def counting_accept(self, chosen, drafts, ndrafts, parents, depth):
        verdict = accept(self, chosen, drafts, ndrafts, parents, depth)
        if running[0] is None:
            return verdict
        trees = parents.tolist() if parents is not None else [None] * len(ndrafts)
        for tree, m, rows, count in zip(trees, ndrafts.tolist(), verdict.rows.tolist(), verdict.count.tolist()):
            if not m:
                continue
            tree = tuple(tree[:m]) if tree is not None else chain(m)
            nodes[running[0], "nodes"] += m
            nodes[running[0], "steps"] += 1
            nodes[running[0], "budget", 0 if tree == chain(m) else m] += 1
            node = -1
            for d, n in enumerate((r - 1 for r in rows[1:count]), 1):  # the accepted nodes, root first
                if n != tree.index(node):
                    left[running[0], d] += 1
                    break
                node = n
        return verdict

    @contextlib.contextmanager
    def around(name: str):
        running[0] = name
        try:
            yield
        finally:
            running[0] = None
    return around, mock.patch.object(TargetAcceptor, "accept", counting_accept)


def run(args: argparse.Namespace) -> dict:
    from peagle_trt.bench.measure import Config, head, measure
    from peagle_trt.bench.prompts import humaneval_prompts
    from peagle_trt.config import SamplingParams, SpecConfig
    from peagle_trt.tokenizer import TextCodec

    drafter, ks, budgets = head(args, "peagle", args.drafter), int_list(args.ks), int_list(args.budgets)
    depth = max(ks)
    chain = f"chain K={depth}"
    configs = ([Config("none", SpecConfig("none", 0), None)]
               + [Config(f"chain K={k}", SpecConfig("peagle", k), drafter) for k in ks]
               + [Config(f"tree B={b}", SpecConfig("peagle", depth, tree_budget=b), drafter) for b in budgets]
               + [Config(f"tree adaptive B<={max(budgets)}",
                         SpecConfig("peagle", depth, tree_budget=max(budgets), adaptive_tree=True), drafter)])
    prompts = [p["prompt"] for p in humaneval_prompts()[:args.prompts]]
    codec = TextCodec(args.target)
    longest = max(len(codec.encode_prompt(p, chat_template=False)) for p in prompts)
    max_seq_len = longest + args.max_tokens + max(ks + budgets) + 16
    params = {"humaneval": SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)}
    rows = []
    for b in int_list(args.batch):
        left, nodes = Counter(), Counter()
        around, patch = watching(left, nodes)
        with patch:
            cell = measure(args, configs, {"humaneval": prompts}, [b], max_seq_len, False, params=params,
                           around=around)
        base = next(r for r in cell if r["config"] == chain)
        for r in cell:
            name, steps = r["config"], nodes[r["config"], "steps"]
            r["nodes_per_step"] = round(nodes[name, "nodes"] / steps, 1) if steps else None
            r["al_over_chain"] = round(r["acceptance_length"] / base["acceptance_length"], 3)
            r["speed_over_chain"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
            r["left_the_chain_at_depth"] = {d: n / args.rounds for (c, d), n in sorted(left.items()) if c == name}
            r["steps_at_budget"] = {k[2]: n / args.rounds for k, n in sorted(nodes.items())
                                    if k[0] == name and k[1] == "budget"}
        rows += cell

    where = f"{args.target.name}, {args.backend}"
    figures = []
    for b in int_list(args.batch):
        trees = [r for r in rows if r["batch"] == b and r["config"].startswith("tree")]
        best_al, fastest = max(trees, key=lambda r: r["acceptance_length"]), max(trees, key=lambda r: r["tokens_per_s"])
        if b == int_list(args.batch)[0]:
            figures.append(Figure(f"draft trees ({where}): {best_al['config']} AL over {chain}",
                                  best_al["al_over_chain"], "x", ">= 1.3x"))
        figures.append(Figure(f"draft trees ({where}), batch {b}: {fastest['config']} tok/s over {chain}",
                              fastest["speed_over_chain"], "x", ">= 1.15x"))
    panels = [(title, "configuration", label, series(rows, "config", key, lambda r: f"batch {r['batch']}"))
              for title, label, key in (("Acceptance", "acceptance length", "acceptance_length"),
                                        ("Wall-clock", "tokens/s over none", "speedup"))]
    return finish(args, f"Draft trees vs chains ({where}), medians of {args.rounds} rounds", [
        table(["batch", "config", "nodes/step", "AL", "AL x chain", "tok/s", "x none", "tok/s x chain", "mismatches",
               "request-steps by budget", "left the top-1 chain at depth (steps)"],
              [[r["batch"], r["config"], f"{r['nodes_per_step']:.1f}" if r["nodes_per_step"] else "",
                f"{r['acceptance_length']:.2f}", f"{r['al_over_chain']:.2f}", f"{r['tokens_per_s']:.1f}",
                f"{r['speedup']:.2f}", f"{r['speed_over_chain']:.2f}", r["mismatches"],
                ", ".join(f"{b}: {n:g}" for b, n in r["steps_at_budget"].items()),
                ", ".join(f"{d}: {n:g}" for d, n in r["left_the_chain_at_depth"].items())
                + (f" of {r['steps']}" if r["left_the_chain_at_depth"] else "")] for r in rows]),
        lines(args, "", panels)],
        {"drafter": str(drafter), "rows": rows}, figures)
