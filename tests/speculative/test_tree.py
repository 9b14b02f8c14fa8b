"""Draft trees (peagle_trt/speculative/tree.py) and tree verification (decoder.py): the best-first tree is the
best ancestor-closed set, static trees parse as vLLM's, and greedy output with trees of several
shapes and budgets is the target's own, token for token, on the torch and onnxruntime executors,
with the trained code pair (its head accepts real drafts, so accepted paths leave the chain and
their KV moves), in batch mixes of trees, chains and plain decoding, through the paged scheduler
under block pressure; the adaptive budget (peagle_trt/speculative/tree_size.py): its choices on synthetic
costs and acceptance, and greedy identity while it switches between chains and trees. Sampling
with trees: tests/speculative/test_sampling.py."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest
import torch

from peagle_trt import speculative_config
from peagle_trt.checkpoint import load_pair
from peagle_trt.config import KVLayout, SamplingParams, SpecConfig
from peagle_trt.demo import code_pair
from peagle_trt.errors import ConfigError
from peagle_trt.executors.onnxruntime import OrtExecutor
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.runtime.scheduler import Request, Scheduler, generate
from peagle_trt.speculative.decoder import SpecDecoder
from peagle_trt.speculative.draft_length import REFRESH, CostTable
from peagle_trt.speculative.tree import best_tree, depths, parse_static, static_nodes, tokens_of, walk
from peagle_trt.speculative.tree_size import PRIOR_WEIGHT, TreeSizePolicy
from peagle_trt.tokenizer import TextCodec
from tests.helpers import MarkovExecutor, collect, new_sequence

PAIR = code_pair()
PROMPTS = ['def read_lines(path):\n    """Return the lines of the file at path."""',
           "class Stack:\n\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
           "def fib(n):\n    if n < 2:\n        return n\n"]
N = 40


# -- construction ------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_best_tree_is_the_most_probable_ancestor_closed_set(seed):
    rng = np.random.default_rng(seed)
    k, w = 3, 3
    logp = np.sort(np.log(rng.dirichlet(np.ones(6), size=k)[:, :w]), axis=1)[:, ::-1]  # [K, W], descending
    prefixes = {p: sum(logp[d, r] for d, r in enumerate(p)) for n in range(1, k + 1)
                for p in itertools.product(range(w), repeat=n)}
    for max_depth in (1, 2, 3):
        for budget in (1, 2, 5, 9):
            nodes = best_tree(logp, budget, max_depth)
            parents = tuple(p for p, _ in nodes)
            assert all(p < i for i, p in enumerate(parents))  # ancestor-closed, parents first
            paths = []
            for p, r in nodes:
                paths.append((paths[p] if p >= 0 else ()) + (r,))
            assert len(set(paths)) == len(paths) and max(map(len, paths)) <= max_depth
            allowed = sorted((s for p, s in prefixes.items() if len(p) <= max_depth), reverse=True)
            # the best budget prefixes (a prefix scores at least its extensions: closed by itself)
            assert sum(prefixes[p] for p in paths) == pytest.approx(sum(allowed[:budget]))


@pytest.mark.parametrize("seed", range(3))
def test_a_spine_keeps_the_chain_and_spends_the_rest_best_first(seed):
    rng = np.random.default_rng(seed)
    logp = np.sort(np.log(rng.dirichlet(np.ones(8), size=4)[:, :4]), axis=1)[:, ::-1]  # [K=4, W=4]
    for budget, spine in ((3, 4), (4, 4), (9, 4), (9, 2)):
        nodes = best_tree(logp, budget, 4, spine=spine)
        assert len(nodes) == budget and all(p < i for i, (p, _) in enumerate(nodes))
        s = min(spine, budget)
        assert nodes[:s] == [(i - 1, 0) for i in range(s)]  # the top-1 chain first
        paths = []
        for p, r in nodes:
            paths.append((paths[p] if p >= 0 else ()) + (r,))
        score = {p: sum(logp[d, r] for d, r in enumerate(p)) for p in paths}
        rest = sorted((sum(logp[d, r] for d, r in enumerate(p)) for n in range(1, 5)
                       for p in itertools.product(range(4), repeat=n) if p not in paths[:s]), reverse=True)
        assert sum(score[p] for p in paths[s:]) == pytest.approx(sum(rest[:budget - s]))  # the best of the rest


def test_static_tree_as_vllm_writes_it():
    paths = parse_static("[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]")
    nodes = static_nodes(paths)
    tokens, parents = tokens_of(nodes, [[10, 11], [20, 21], [30, 31]])
    assert parents == (-1, -1, 0, 0, 1, 2) and depths(parents) == [1, 1, 2, 2, 2, 3]
    assert tokens == [10, 11, 20, 21, 20, 30]
    for bad, why in (("[(0, 0)]", "no parent"), ("[(0,), (0,)]", "twice"), ("[]", "non-empty"),
                     ("[(0,), (-1,)]", "integers >= 0"), ("(0,", "rank tuples")):
        with pytest.raises(ConfigError, match=why):
            parse_static(bad)


def test_walk_follows_the_target_and_emits_the_first_miss():
    tokens, parents = [5, 6, 7, 8], (-1, -1, 1, 1)  # root -> 5, 6; 6 -> 7, 8
    assert walk(tokens, parents, {0: 6, 2: 9}.__getitem__) == ([1], [6, 9])  # no child 9 under 6
    assert walk(tokens, parents, {0: 6, 2: 8, 4: 3}.__getitem__) == ([1, 3], [6, 8, 3])
    assert walk(tokens, parents, {0: 1}.__getitem__) == ([], [1])
    assert walk([], (), {0: 4}.__getitem__) == ([], [4])


def test_speculative_config_trees():
    parse = speculative_config.parse
    spec = parse('{"parallel_drafting": true, "speculative_token_tree": "[(0,), (1,), (0, 0)]"}').spec
    assert spec.num_spec_tokens == 2 and spec.static_tree == ((0,), (1,), (0, 0)) and spec.max_nodes == 3
    assert parse(json.dumps(speculative_config.to_vllm(spec))).spec == spec
    spec = parse('{"num_speculative_tokens": 4, "draft_tree_budget": 8, '
                 '"draft_tree_budget_per_batch_size": [[1, 2, 12], [3, 64, 0]]}').spec
    assert [spec.tree_budget_for_batch(b) for b in (1, 2, 3, 99)] == [12, 12, 0, 0] and spec.max_nodes == 12
    assert parse(json.dumps(speculative_config.to_vllm(spec))).spec == spec
    spec = parse('{"num_speculative_tokens": 2, "draft_tree_budget": 16, "adaptive_draft_tree_budget": true}').spec
    assert spec.adaptive_tree and spec.max_nodes == 16
    assert parse(json.dumps(speculative_config.to_vllm(spec))).spec == spec
    built = SpecConfig("peagle", 2, tree_budget=16, adaptive_tree=True)  # serve-time keys without a tree: the build's
    serve = parse('{"parallel_drafting": true, "num_speculative_tokens": 2}')
    assert speculative_config.for_built(built, serve) == built
    for text, why in (
            ('{"adaptive_draft_tree_budget": true}', "draft_tree_budget"),
            ('{"adaptive_draft_tree_budget": 1, "draft_tree_budget": 8}', "true or false"),
            ('{"adaptive_draft_tree_budget": true, "speculative_token_tree": "[(0,), (1,)]"}', "not a static tree"),
            ('{"adaptive_draft_tree_budget": true, "draft_tree_budget": 8, "adaptive_num_speculative_tokens": true}',
             "use one"),
            ('{"speculative_token_tree": "[(0,), (1,)]", "num_speculative_tokens": 3}', "must be equal"),
            ('{"speculative_token_tree": [[0]]}', "must be a string"),
            ('{"draft_tree_budget": 0}', r"\[1, 64\]"),
            ('{"draft_tree_budget": 4, "adaptive_num_speculative_tokens": true}', "fixed K"),
            ('{"draft_tree_budget": 4, "speculative_token_tree": "[(0,)]"}', "not both"),
            ('{"draft_tree_budget_per_batch_size": [[2, 4, 8]]}', "start at 1")):
        with pytest.raises(ConfigError, match=why):
            parse(text)


# -- adaptive budgets (peagle_trt/speculative/tree_size.py) ----------------------------------------------

def budgets_with(verify: dict[int, float], extra: dict[int, float], k: int = 2, cap: int = 16) -> TreeSizePolicy:
    """A rule for one request at depth k with verify seconds by rows and, per budget, the drafts a
    tree of that many nodes accepts beyond the chain (20 steps at the cap, the chain accepting 1)."""
    rule = TreeSizePolicy(SpecConfig("peagle", k, tree_budget=cap, adaptive_tree=True), CostTable(), CostTable())
    for rows, seconds in verify.items():
        rule.verify_cost.record(1, rows, seconds)
        rule.draft_cost.record(1, rows, 0.1)
    for step in range(20):  # paths of node indices: the spine's first node, then what the budget adds
        gained = [n for n in sorted(extra) if step < 20 * extra[n]]  # budgets whose sibling was accepted
        path = [0] + ([min(gained) - 1] if gained else [])
        rule.record([(k, cap, path)])
    return rule


def test_adaptive_budget_takes_the_chain_when_rows_are_dear_and_a_tree_when_siblings_pay():
    accepts = {8: 0.5, 16: 0.6}  # a tree of 8 adds half a token per step, 16 a little more
    cheap = budgets_with({2: 1.0, 4: 1.0, 8: 1.02, 16: 1.3}, accepts)
    assert cheap.choose(1, 1, 2) == 8  # rows nearly free up to 8: (2 + 0.5 * 20/24) / 1.12 beats 2 / 1.1
    dear = budgets_with({2: 1.0, 16: 2.0}, accepts)  # 8 rows: interpolated, 1.43 s
    assert dear.choose(1, 1, 2) == 0
    useless = budgets_with({2: 1.0, 4: 1.0, 8: 1.02, 16: 1.3}, {})  # nothing beyond the chain: no tree
    assert useless.choose(1, 1, 2) == 0
    e = cheap.expected_tokens(cheap.readings[2], [2, 4, 8, 16], 2)
    assert e == pytest.approx([2.0, 2.0, 2 + 10 / (20 + PRIOR_WEIGHT), 2 + 12 / (20 + PRIOR_WEIGHT)])


def test_one_step_measures_every_smaller_budget_and_the_chain():
    rule = TreeSizePolicy(SpecConfig("peagle", 2, tree_budget=8, adaptive_tree=True), CostTable(), CostTable())
    rule.record([(2, 8, [0, 3, 5]), (2, 8, [0, 1]), (2, 2, [0])])  # two trees of 8 nodes, a chain of 2
    tree, chain = rule.readings[2]
    assert (tree.nodes, tree.requests, tree.chain) == (8, 2, 1 + 2)  # along the spine: 1 and 2 accepted
    assert tree.extra.tolist() == [-3, -1, 0, 0, 1, 1, 2, 2, 2]  # beyond the chain with the first n nodes
    assert (chain.nodes, chain.requests, chain.chain) == (2, 1, 1)


def test_adaptive_budget_explores_the_cap_and_respects_the_schedule():
    spec = SpecConfig("peagle", 2, tree_schedule=((1, 1, 16), (2, 8, 4)), adaptive_tree=True)
    rule = TreeSizePolicy(spec, CostTable(), CostTable())
    assert rule.choose(1, 1, 2) == 0  # a batch size never verified: the chain first
    rule.verify_cost.record(1, 2, 1.0)
    assert rule.choose(1, 1, 2) == 16  # no step at the cap yet: one measures every budget below
    rule.record([(2, 16, [0, 1])])  # the chain accepted both: no tree adds anything
    assert rule.choose(1, 1, 2) == 0
    rule.record([(2, 16, [2])] * 4)  # the top-1's sibling (node 2), in every tree from 3 nodes up
    rule.verify_cost.record(3, 2, 1.0)
    assert rule.choose(3, 3, 2) == 4  # three running: a tree pays, up to the schedule's cap 4
    assert rule.choose(3, 3, 0) == 0  # nothing drafted: nothing to build
    fixed = TreeSizePolicy(SpecConfig("peagle", 2, tree_schedule=((1, 1, 16), (2, 8, 4))), CostTable(), CostTable())
    assert [fixed.choose(1, b, 2) for b in (1, 2, 9)] == [16, 4, 4]  # fixed: the schedule's


def test_adaptive_budget_holds_near_ties_and_refreshes_the_runner_up():
    def rule(last: int, verify16: float) -> int:
        budgets = budgets_with({2: 1.0, 16: verify16}, {16: 0.5}, cap=16)
        budgets.last[1] = last
        return budgets.choose(1, 1, 2)

    # E: 2 for the chain, 2 + 10 / 24 = 2.42 for 16 rows; cost 1.1 for the chain
    assert rule(0, 1.26) == 0 and rule(16, 1.26) == 16  # 16 at 2.42 / 1.36 within 3% of 2 / 1.1: kept
    assert rule(0, 1.1) == 16 and rule(16, 1.5) == 0  # clearly better / worse: switched
    budgets = budgets_with({2: 1.0, 4: 1.0, 8: 1.02, 16: 1.3}, {8: 0.5})
    picks = [budgets.choose(1, 1, 2) for _ in range(2 * REFRESH)]
    assert [i for i, c in enumerate(picks) if c != 8] == [REFRESH - 1, 2 * REFRESH - 1]


# -- greedy: the target's own output -----------------------------------------------------------

@pytest.fixture(scope="module")
def pair():
    spec = SpecConfig("peagle", 7)
    target, drafter = load_pair(PAIR, PAIR / "drafter-peagle", spec).build()
    codec = TextCodec(PAIR)
    prompts = [codec.encode_prompt(p, chat_template=False) for p in PROMPTS]
    ref = SpecDecoder(TorchExecutor(target, None, 1, 512), SpecConfig("none", 0))
    refs = [generate(ref, p, SamplingParams(max_tokens=N, ignore_eos=True)).output for p in prompts]
    return target, drafter, prompts, refs


class Moves:
    """Wraps an executor; counts the KV moves (accepted paths that left the first child chain)."""

    def __init__(self, inner):
        self.inner, self.moves = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def move_kv(self, tables, src, dst):
        self.moves += 1
        self.inner.move_kv(tables, src, dst)


TREES = {  # (K, tree): budget trees hold the K-chain (their spine) and B - K nodes around it
    "budget-4": (2, dict(tree_budget=4)), "budget-8": (4, dict(tree_budget=8)), "budget-16": (6, dict(tree_budget=16)),
    "static": (5, dict(static_tree=parse_static("[(0,), (1,), (2,), (0, 0), (1, 0), (0, 1), (0, 0, 0), "
                                                "(0, 0, 1), (0, 0, 0, 0), (0, 0, 0, 0, 0)]")))}


def executor(backend, target, drafter, spec, kv):
    if backend == "torch":
        return TorchExecutor(target, drafter, kv)
    return OrtExecutor.from_models(target, drafter, spec, kv)


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("shape", sorted(TREES))
def test_greedy_trees_equal_target_only(pair, backend, shape):
    target, drafter, prompts, refs = pair
    k, tree = TREES[shape]
    spec = SpecConfig("peagle", k, **tree)
    ex = Moves(executor(backend, target, drafter, spec, KVLayout.for_sequences(1, 512)))
    dec = SpecDecoder(ex, spec)
    accepted = steps = nodes = 0
    for prompt, ref in zip(prompts, refs):
        seq = generate(dec, prompt, SamplingParams(max_tokens=N, ignore_eos=True))
        assert seq.output == ref
        accepted, steps, nodes = accepted + seq.stats.accepted, steps + seq.stats.steps, nodes + seq.stats.drafted
    assert accepted / steps > 1.0 and nodes >= steps * 4  # real trees, real acceptance
    assert ex.moves > 0  # some accepted path left the first-child chain: its KV moved into place


def test_a_batch_mixing_trees_chains_and_plain_steps(pair):
    """One verify holding a tree, a chain and a request without drafts (hand-set drafts: some right,
    some wrong), then the decoder's own steps: every output is the target's."""
    target, drafter, prompts, refs = pair
    spec = SpecConfig("peagle", 4, tree_budget=6)
    dec = SpecDecoder(TorchExecutor(target, drafter, 3, 512), spec)
    params = SamplingParams(max_tokens=N, ignore_eos=True)
    seqs = [new_sequence(dec, p, params, i) for i, p in enumerate(prompts)]
    dec.prefill(seqs)
    rng = random.Random(0)
    for step in range(6):
        for i, s in enumerate(seqs):
            ref, at = refs[i], len(s.output)
            truth = ref[at:at + 4] + [0] * 4
            if (step + i) % 3 == 0:  # a tree: a wrong first child, the right path below its sibling
                s.drafts = [truth[0] + 1, truth[0], truth[1], truth[2], rng.randrange(500)]
                s.parents = (-1, -1, 1, 2, 1)
            elif (step + i) % 3 == 1:  # a chain, right for two
                s.drafts, s.parents = [truth[0], truth[1], truth[2] + 1], ()
            else:  # no drafts: plain decoding
                s.drafts, s.parents = [], ()
        dec.batch = len(seqs)
        dec.step(seqs)
    while not all(s.finished for s in seqs):
        dec.step(seqs)
    assert [s.output for s in seqs] == refs


@pytest.mark.parametrize("adaptive", [False, True])
def test_scheduler_under_block_pressure_with_tree_budget_by_batch_size(pair, adaptive):
    """Requests arriving and leaving over a small paged cache (preemptions): the tree budget and K
    follow the batch size (a tree alone, a chain at 2, plain decoding at 3, a small tree above);
    adaptive: the budget is each step's choice up to those (chains and trees in one run)."""
    target, drafter, prompts, refs = pair
    spec = SpecConfig("peagle", 4, k_schedule=((1, 2, 4), (3, 3, 0), (4, 64, 4)),
                      tree_schedule=((1, 1, 16), (2, 2, 0), (3, 64, 10)), adaptive_tree=adaptive)
    kv = KVLayout(num_blocks=36, max_len=160, max_batch=6, block_size=8, max_rows=20)
    sched = Scheduler(SpecDecoder(TorchExecutor(target, drafter, kv), spec), prefill_chunk=16)
    outputs: dict = {}
    load = [(i % 3, 12 + 7 * i) for i in range(6)]
    for n, (p, m) in enumerate(load):
        sched.add(Request(str(n), prompts[p], SamplingParams(max_tokens=min(m, N), ignore_eos=True),
                          collect(outputs)))
        if n % 2:
            sched.step()
    while sched.has_work:
        sched.step()
        sched.blocks.check([r.seq for r in sched.running])
    for n, (p, m) in enumerate(load):
        assert outputs[str(n)]["ids"] == refs[p][:min(m, N)], n
    assert sched.blocks.used_blocks == 0
    steps = sched.decoder.tree_size.steps_at_budget
    assert steps[0] > 0 and steps[16] > 0 and steps[10] > 0  # chains and trees of both schedules' caps


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_greedy_adaptive_budgets_equal_target_only(pair, backend):
    """The rule's choices (chains, trees of 16, 8 or 4 nodes from one step to the next, on this
    machine's timings) change no token."""
    target, drafter, prompts, refs = pair
    spec = SpecConfig("peagle", 2, tree_budget=16, adaptive_tree=True)
    ex = Moves(executor(backend, target, drafter, spec, KVLayout.for_sequences(1, 512)))
    dec = SpecDecoder(ex, spec)
    for prompt, ref in zip(prompts, refs):
        assert generate(dec, prompt, SamplingParams(max_tokens=N, ignore_eos=True)).output == ref
    assert dec.tree_size.steps_at_budget[0] > 0 and dec.tree_size.steps_at_budget[16] > 0  # the chain, the cap explored
    assert dec.draft_length.verify_cost.curve(1) and dec.tree_size.readings[2]


def test_trees_refuse_windowed_targets():
    ex = MarkovExecutor(torch.full((4, 4), 0.25))
    ex.windows = (0, 8)  # a sliding-window KV group
    with pytest.raises(ConfigError, match="full-attention target"):
        SpecDecoder(ex, SpecConfig("peagle", 3, tree_budget=4), proposer=object())


def test_greedy_trees_with_the_sequential_eagle3_head(pair):
    """EAGLE-3 heads (K sequential passes): each step's top candidates make the tree just the same."""
    _, _, prompts, refs = pair
    spec = SpecConfig("eagle3", 3, tree_budget=6)
    target, drafter = load_pair(PAIR, PAIR / "drafter-eagle3", spec).build()
    ex = Moves(TorchExecutor(target, drafter, 1, 512))
    dec = SpecDecoder(ex, spec)
    for prompt, ref in zip(prompts[:2], refs[:2]):
        seq = generate(dec, prompt, SamplingParams(max_tokens=N, ignore_eos=True))
        assert seq.output == ref and seq.stats.accepted > 0 and seq.stats.drafted > 3 * seq.stats.steps
