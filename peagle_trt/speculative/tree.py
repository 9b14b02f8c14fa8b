"""Draft trees: which candidate tokens one verify checks, and the path a step accepts.

P-EAGLE's one drafter pass gives a distribution for each of the K future positions, all
conditioned on the same accepted context. A chain keeps each position's argmax; a tree keeps
the next-best candidates too, and the target checks every node in the same forward (an ancestor
mask), so one wrong guess no longer ends the step when a sibling was right.

A tree of N nodes hangs below the root (the last generated token): node i has a token, a parent
`parents[i]` (-1: the root; always < i) and a depth (1 + its parent's). A chain is the tree
parents = (-1, 0, 1, ..., N-2). Verify rows: row 0 the root, row i + 1 node i, at RoPE positions
cur + depth and KV slots cur + row (ops.reference.kv_attention with a tree mask).

    best_tree   the B best prefixes by the product of per-depth probabilities (best-first over a
                heap: the next best prefix is the next sibling or the first child of one taken,
                so the result is ancestor-closed and optimal for that score; DDTree), depth <= K;
                the decoder puts the step's top-1 chain first (its spine) and spends the rest of
                the budget best-first: P-EAGLE's per-position probabilities are marginals over
                the unknown tokens before them, far below the acceptance of a draft whose prefix
                was accepted, so the pure product score trades the deep chain for siblings
                (measured on the code pair: AL 2.2 at B = 16 vs 3.5 for the K = 7 chain;
                docs/BENCHMARKS.md, "trees")
    parse_static, static_nodes  vLLM's `speculative_token_tree`: rank paths, "(0,), (1,), (0, 0)"
                = the top-1 and top-2 at depth 1, then the top-1 at depth 2 below the top-1
    walk        the accepted path: from the root, the target's token at each node (argmax, or a
                sample from its distribution), then to the child holding that token; the first
                token with no matching child is emitted too (correction or bonus). Each emitted
                token is the target's choice at its true context: the output is the target's own
                (greedy), or exactly distributed as the target's (sampling), whatever the tree.
"""

from __future__ import annotations

import ast
import heapq
import itertools
from collections.abc import Callable

import numpy as np

from peagle_trt.errors import ConfigError


def chain(n: int) -> tuple[int, ...]:
    """Parents of an n-node chain."""
    return tuple(range(-1, n - 1))


def depths(parents) -> list[int]:
    """Depth (1 ..) of every node."""
    out = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def best_tree(logp: np.ndarray, budget: int, max_depth: int, spine: int = 0) -> list[tuple[int, int]]:
    """The `budget` most probable prefixes as nodes (parent, rank): logp [K, W] the per-depth
    log-probabilities of the drafter's top-W candidates, sorted descending within a depth. Node
    order is the order of selection (a parent before its children); depth <= min(K, max_depth).
    `spine` s: the top-1 chain of depth s comes first (the step's chain: the tree then accepts at
    least what the chain would), the rest of the budget best-first around it."""
    depth_cap = min(max_depth, logp.shape[0])
    width = logp.shape[1]
    nodes: list[tuple[int, int]] = []
    node_depth: list[int] = []
    heap: list = []  # (-score, tie, parent, rank)
    tie = itertools.count()

    def take(parent: int, rank: int, score: float, on_spine: bool = False) -> None:
        d = 1 if parent < 0 else node_depth[parent] + 1
        nodes.append((parent, rank))
        node_depth.append(d)
        if rank + 1 < width:  # its next sibling
            heapq.heappush(heap, (-(score - float(logp[d - 1, rank]) + float(logp[d - 1, rank + 1])), next(tie),
                                  parent, rank + 1))
        if d < depth_cap and not (on_spine and d < spine_len):  # its first child (on the spine: the next one)
            heapq.heappush(heap, (-(score + float(logp[d, 0])), next(tie), len(nodes) - 1, 0))

    spine_len = min(spine, depth_cap, budget)
    score = 0.0
    for d in range(spine_len):
        score += float(logp[d, 0])
        take(d - 1, 0, score, on_spine=True)
    if not spine_len and budget > 0 and depth_cap > 0:
        heapq.heappush(heap, (-float(logp[0, 0]), next(tie), -1, 0))
    while heap and len(nodes) < budget:
        neg, _, parent, rank = heapq.heappop(heap)
        take(parent, rank, -neg)
    return nodes


def parse_static(text: str, max_nodes: int = 64) -> tuple[tuple[int, ...], ...]:
    """vLLM's `speculative_token_tree` string -> rank paths sorted by depth then rank (a parent
    before its children); ConfigError names what is wrong."""
    where = "speculative_token_tree"
    try:
        value = ast.literal_eval(text) if isinstance(text, str) else text
    except (ValueError, SyntaxError) as exc:
        raise ConfigError(f"{where} must be a list of rank tuples like \"[(0,), (1,), (0, 0)]\": {exc}") from exc
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"{where} must be a non-empty list of rank tuples like \"[(0,), (1,), (0, 0)]\"")
    paths = []
    for p in value:
        if (not isinstance(p, (list, tuple)) or not p
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p)):
            raise ConfigError(f"{where}: {p!r} is not a path of ranks (a non-empty tuple of integers >= 0)")
        paths.append(tuple(p))
    if len(set(paths)) != len(paths):
        raise ConfigError(f"{where}: a path appears twice")
    if len(paths) > max_nodes:
        raise ConfigError(f"{where}: {len(paths)} nodes, at most {max_nodes}")
    known = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in known:
            raise ConfigError(f"{where}: {p} has no parent {p[:-1]} (every prefix of a path must be a node)")
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


def static_nodes(paths: tuple[tuple[int, ...], ...]) -> list[tuple[int, int]]:
    """Rank paths (parse_static's order) -> nodes (parent, rank)."""
    index = {p: i for i, p in enumerate(paths)}
    return [(index[p[:-1]] if len(p) > 1 else -1, p[-1]) for p in paths]


def tokens_of(nodes: list[tuple[int, int]], top_ids: list[list[int]]) -> tuple[list[int], tuple[int, ...]]:
    """(tokens, parents) of `nodes` (parent, rank) over the candidates top_ids [K][W]."""
    parents = tuple(p for p, _ in nodes)
    d = depths(parents)
    return [top_ids[d[i] - 1][r] for i, (_, r) in enumerate(nodes)], parents


def walk(tokens: list[int], parents: tuple[int, ...], choose: Callable[[int], int]) -> tuple[list[int], list[int]]:
    """(accepted node indices, emitted tokens): from row 0, t = choose(row); go to the child whose
    token is t while there is one; the last t (no such child) ends the list."""
    children: dict[int, dict[int, int]] = {}
    for n, p in enumerate(parents):
        children.setdefault(p, {}).setdefault(tokens[n], n)  # a repeated token: the first sibling
    path, emitted, node = [], [], -1
    while True:
        t = choose(node + 1)
        emitted.append(t)
        nxt = children.get(node, {}).get(t)
        if nxt is None:
            return path, emitted
        path.append(nxt)
        node = nxt
