"""How many draft-tree nodes to verify next step: the budget fixed, by batch size, or adaptive.

The drafter's pass gives the top candidates of each of the k positions; a budget c > k builds the
best-first tree of c nodes around the k chain (speculative/tree.py best_tree, its spine), 0 keeps
the chain. The verify is padded to the batch's largest tree, so the rule picks one budget per
drafting call (per step), like draft_length.py's k.

    cap   = SpecConfig.tree_budget_for_batch(B)             (B: running requests; 0: the chain)
    fixed : budget = cap
    adaptive (`SpecConfig.adaptive_tree`):
            budget = argmax_{c in C}  b E(c) / (T_verify(b, n_c) + T_draft(b, n_c))
        C      = {0} + {cap, cap/2, cap/4, ...}, those above k    (0: the chain of k)
        n_c    = verify rows per request past the root: k for the chain, c for a tree
        E(c)   = 1 + A + X(c)                                    tokens per request and step
        A      = sum a_i(k) / r(0)            the chain's accepted drafts per request-step
        X(c)   = sum [a_i(c) - a_i(k)] / (r(c) + M)   what the tree adds, over the r(c)
                 request-steps that verified at least c nodes, shrunk towards 0 (M = 4: a tree is
                 assumed no better than its chain until measured)
        a_i(n) = the drafts request i would have accepted with only the first n nodes of its tree:
                 the nodes of its accepted path with an index below n
        sums over the last STEPS steps at this k (acceptance depends on the depth, not on b)
        T_*    = draft_length.py's CostTable of the step's verify and drafting, keyed by rows per
                 request (the chain's k, a tree's c): medians of recent readings per batch size b
    Why a_i(n) is measured, not guessed: the first n nodes of a best-first tree of c >= n nodes
    are the tree of budget n (for n <= k, the chain of n: the spine comes first), and a walk in the
    smaller tree meets the same target tokens (greedy, or the same samples) until it leaves it; so
    one step at budget c measures every budget up to c, and the chain, on the same requests.
    Exploration: while none of the last STEPS steps at this k verified `cap` nodes, the rule runs
    `cap` (measuring every budget below it); its first step at a batch size with no verify reading
    runs the chain. HOLD and REFRESH as draft_length.py's: a batch size keeps its last budget
    while within 3% of the best, and every REFRESH-th choice takes the runner-up for one step.
Why measured acceptance, not the drafter's path probabilities: P-EAGLE's per-position
probabilities are marginals over the unknown tokens before them, far below the acceptance of a
node whose ancestors were accepted (speculative/tree.py), so they would need a calibration that
the readings above already are, for every budget at once.
Adaptive K is refused alongside (config.py): both rules pick a step's verify rows from the one
cost table, and a joint (k, budget) choice, with adaptive K's plain steps and probes, is not
modelled; a K schedule caps k under either.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

from peagle_trt.config import SpecConfig
from peagle_trt.speculative.draft_length import REFRESH, CostTable, _at, ranked

PRIOR_WEIGHT = 4.0  # M: request-steps of "no gain over the chain" in each tree budget's estimate
STEPS = 64  # the last steps per depth k whose acceptance the gains are read from


@dataclass(frozen=True)
class Reading:
    """One verify step's requests that ran the same tree size: `nodes` rows past the root each
    (their chain: k), `requests` of them accepting `chain` drafts along the k chain in all, and
    extra[n] = sum_i a_i(n) - a_i(k) for n = 0 .. nodes."""
    nodes: int
    requests: int
    chain: int
    extra: np.ndarray


class TreeSizePolicy:
    def __init__(self, spec: SpecConfig, verify_cost: CostTable, draft_cost: CostTable):
        self.spec, self.verify_cost, self.draft_cost = spec, verify_cost, draft_cost
        self.readings: dict[int, collections.deque] = {}  # k -> Reading, newest last
        self.steps_at_budget: collections.Counter = collections.Counter()  # verify steps by budget (0: chain)
        self.choices = 0
        self.last: dict[int, int] = {}  # batch size -> the budget chosen last for it

    def choose(self, b: int, batch: int, k: int) -> int:
        """The tree budget (0: the chain) for the next verify of `b` requests drafting k positions,
        `batch` requests running."""
        cap = self.spec.tree_budget_for_batch(batch) if k else 0
        if not self.spec.adaptive_tree:
            return cap
        budgets = [0] + sorted({cap >> j for j in range(7) if cap >> j > k})  # 0 and the trees above k
        verify = self.verify_cost.curve(b)
        if len(budgets) == 1 or verify is None:
            return 0  # no tree above k, or a batch size never verified: the chain first
        readings = self.readings.get(k, ())
        if not any(r.nodes >= cap for r in readings):
            return cap  # one step at the cap measures every budget below it
        rows = [k] + budgets[1:]
        gain = self.expected_tokens(readings, rows, k)  # [len(budgets)]
        draft = self.draft_cost.curve(b)
        cost = np.array([_at(verify, n) + _at(draft, n) for n in rows])
        last = self.last.get(b)
        order = ranked(gain / cost, budgets.index(last) if last in budgets else None)
        self.choices += 1
        self.last[b] = budgets[order[0]]  # a refresh measures the runner-up once; the hold stays with the best
        return budgets[order[1] if self.choices % REFRESH == 0 else order[0]]

    @staticmethod
    def expected_tokens(readings, rows: list[int], k: int) -> np.ndarray:
        """E(c) for the budgets whose rows are `rows` (rows[0] = k: the chain)."""
        requests = sum(r.requests for r in readings)
        base = 1.0 + sum(r.chain for r in readings) / requests
        out = [base]
        for n in rows[1:]:
            seen = [r for r in readings if r.nodes >= n]
            out.append(base + sum(float(r.extra[n]) for r in seen) / (sum(r.requests for r in seen) + PRIOR_WEIGHT))
        return np.array(out)

    def record(self, taken: list[tuple[int, int, list[int]]]) -> None:
        """A verify's requests as (k, nodes, accepted path's node indices, rising)."""
        groups: dict[tuple[int, int], list] = collections.defaultdict(list)
        for k, nodes, path in taken:
            groups[k, nodes].append(path)
        for (k, nodes), paths in groups.items():
            a = np.array([np.searchsorted(p, np.arange(nodes + 1)) for p in paths])  # [r, nodes+1]: a_i(n)
            self.readings.setdefault(k, collections.deque(maxlen=STEPS)).append(
                Reading(nodes, len(paths), int(a[:, k].sum()), (a - a[:, k:k + 1]).sum(axis=0)))
