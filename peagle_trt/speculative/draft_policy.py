"""The step's one draft-policy seam: how many drafts (and tree nodes) before a step, what it saw after.

    choose(stats, b, batch, k_max) -> k      draft_length.py: K fixed, by batch size, or adaptive
    budget(b, batch, k)            -> nodes  tree_size.py: 0 (the chain), fixed, by batch, adaptive
    observe(StepReport)                      after a verify: its shape, time and acceptance
    observe_draft(b, rows, seconds)          after a timed drafting pass
The decoder (decoder.py) asks before it drafts and reports after it verifies; it holds no rule's
state itself. `draft_length` (DraftLengthPolicy) and `tree_size` (TreeSizePolicy) stay reachable for
metrics (steps by k, by budget).
Tested by tests/speculative/test_draft_length.py and test_tree.py through the decoder.
"""

from __future__ import annotations

from dataclasses import dataclass

from peagle_trt.config import SpecConfig
from peagle_trt.speculative.draft_length import DraftLengthPolicy
from peagle_trt.speculative.stats import SpecStats
from peagle_trt.speculative.tree_size import TreeSizePolicy


@dataclass(frozen=True)
class StepReport:
    """One verify: `requests` of them, `rows` draft rows each past the root (padded), a tree or
    chains, the verify half's seconds (None: not timed), and per request that drafted (depth,
    nodes, accepted path's node indices, measured: its acceptance was the target's, unconstrained)."""
    requests: int
    rows: int
    tree: bool
    verify_s: float | None
    accepted: tuple[tuple[int, int, tuple[int, ...], bool], ...]


class DraftPolicy:
    def __init__(self, spec: SpecConfig):
        self.spec = spec
        self.draft_length = DraftLengthPolicy(spec)
        self.tree_size = TreeSizePolicy(spec, self.draft_length.verify_cost, self.draft_length.draft_cost)
        self.adaptive = spec.adaptive or spec.adaptive_tree  # a rule reads the steps' costs

    def choose(self, stats: list[SpecStats], batch: int, k_max: int) -> int:
        return self.draft_length.choose(stats, batch, k_max)

    def budget(self, b: int, batch: int, k: int) -> int:
        return self.tree_size.choose(b, batch, k)

    def observe(self, report: StepReport) -> None:
        self.draft_length.steps_at_k[report.rows] += 1
        self.tree_size.steps_at_budget[report.rows if report.tree else 0] += 1
        for depth, _, path, _ in report.accepted:
            self.draft_length.global_stats.record_step(depth, len(path))
        if report.verify_s is not None:
            self.draft_length.verify_cost.record(report.requests, report.rows, report.verify_s)
        if self.spec.adaptive_tree:
            self.tree_size.record([(d, n, list(p)) for d, n, p, measured in report.accepted if measured])

    def observe_draft(self, b: int, rows: int, seconds: float) -> None:
        self.draft_length.draft_cost.record(b, rows, seconds)
