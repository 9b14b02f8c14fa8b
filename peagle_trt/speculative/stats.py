"""Acceptance statistics, one counter dataclass for a request or for a whole server.

Formulas (vLLM conventions; "step" = one verify of K drafts):
  acceptance_length      = 1 + accepted / steps            (includes the bonus/correction token)
  draft_accept_rate      = accepted / drafted               (drafted = steps * K; with draft trees
                                                             the nodes verified: per_step_drafted
                                                             holds each step's tree size)
  accept_rate_per_pos[i] = accepted_at_pos[i] / steps        (joint: >= i+1 drafts accepted)
Identity: acceptance_length = 1 + sum(accept_rate_per_pos).
acceptance_histogram: dense, K + 1 counts (j: the steps that accepted exactly j drafts), the
shape of vLLM's per-request `metrics.speculative_decoding` (openai_frontend/app.py).
Recording a step is one histogram increment (the hot path); the per-position counts derive
from it: accepted_at_pos[i] = number of steps that accepted more than i drafts.
When k varies per step (K schedule, adaptive K: draft_length.py), position i + 1 is only tried
in steps that drafted it and accepted the i before: `tries[i]` counts those, `hits[i]` the
accepted ones, and hits[i] / tries[i] is the acceptance at position i + 1 given the prefix.
`per_step_drafted` / `per_step_accepted` list every step (one byte each; vLLM's detailed
per-request metrics).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_spec_tokens: int = 0
    steps: int = 0  # verify steps that carried drafts
    drafted: int = 0
    histogram: dict = field(default_factory=dict)  # drafts accepted in a step -> number of steps
    target_forwards: int = 0
    drafter_forwards: int = 0
    tokens: int = 0  # generated tokens
    tries: list = field(default_factory=list)  # [K] steps that verified position i + 1 after i accepted
    keep_steps: bool = True  # keep the per-step lists (a request's; not a server's running totals)
    per_step_drafted: array = field(default_factory=lambda: array("B"))
    per_step_accepted: array = field(default_factory=lambda: array("B"))

    def __post_init__(self):
        if not self.tries:
            self.tries = [0] * self.num_spec_tokens

    def record_step(self, num_drafts: int, num_accepted: int, depth: int | None = None) -> None:
        """A step that verified `num_drafts` tokens (a chain, or a tree's nodes: its size) of which
        `num_accepted` were accepted; `depth`: the tree's (None: a chain, = num_drafts)."""
        depth = num_drafts if depth is None else depth
        self.steps += 1
        self.drafted += num_drafts
        self.histogram[num_accepted] = self.histogram.get(num_accepted, 0) + 1
        tries = self.tries
        if len(tries) < depth:  # a decoder driving more drafts than its config's K (tests)
            tries.extend([0] * (depth - len(tries)))
        for i in range(min(depth, num_accepted + 1)):
            tries[i] += 1
        if self.keep_steps:
            self.per_step_drafted.append(num_drafts)
            self.per_step_accepted.append(num_accepted)

    def merge(self, other: SpecStats) -> None:
        for a, n in other.histogram.items():
            self.histogram[a] = self.histogram.get(a, 0) + n
        for i, n in enumerate(other.tries[:len(self.tries)]):
            self.tries[i] += n
        for name in ("steps", "drafted", "target_forwards", "drafter_forwards", "tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def accepted(self) -> int:
        return sum(a * n for a, n in self.histogram.items())

    @property
    def accepted_at_pos(self) -> list[int]:
        depth = max([self.num_spec_tokens, *self.histogram]) if self.histogram else self.num_spec_tokens
        return [sum(n for a, n in self.histogram.items() if a > i) for i in range(depth)]

    @property
    def hits(self) -> list[int]:
        """Steps that accepted position i + 1 (accepted_at_pos, one entry per `tries` entry)."""
        return self.accepted_at_pos[:len(self.tries)]

    @property
    def acceptance_histogram(self) -> list[int]:
        """Dense: entry j = steps that accepted exactly j drafts, j = 0 .. K."""
        depth = max([self.num_spec_tokens, *self.histogram]) if self.histogram else self.num_spec_tokens
        return [self.histogram.get(j, 0) for j in range(depth + 1)]

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.steps if self.steps else 1.0

    @property
    def draft_accept_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def accept_rate_per_pos(self) -> list[float]:
        return [n / self.steps for n in self.accepted_at_pos] if self.steps else []

    def to_dict(self) -> dict:
        return {"acceptance_length": round(self.acceptance_length, 4),
                "draft_accept_rate": round(self.draft_accept_rate, 4),
                "accept_rate_per_pos": [round(r, 4) for r in self.accept_rate_per_pos],
                "num_spec_tokens": self.num_spec_tokens, "steps": self.steps,
                "drafted": self.drafted, "accepted": self.accepted, "acceptance_histogram": self.acceptance_histogram,
                "target_forwards": self.target_forwards, "drafter_forwards": self.drafter_forwards,
                "tokens": self.tokens, "per_step_drafted": self.per_step_drafted.tolist(),
                "per_step_accepted": self.per_step_accepted.tolist()}
