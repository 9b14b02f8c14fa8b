"""The speculative step reads the device back ONCE per step (issue 57): the accepted tokens and
counts, one copy; everything after it is host bookkeeping.

Counted: every tensor-to-host conversion during `SpecDecoder.step` (tolist, item, int, float,
bool, index, cpu, nonzero: on a GPU each one waits for the device). Not counted: `.numpy()`,
which a device tensor refuses (it needs `.cpu()` first, counted); the step's CPU argmax reads
a host tensor's numpy view. At batch 1 and 8, every spec mode, trees and grammar off, the torch
executor on CPU (its forwards included: attention spans come from the host, ops.reference.key_span).
Before issue 57 the same count gave 9 (none), 16 (eagle3 K = 3) and 12 (peagle K = 3) per step
(batch 1 and 8 alike: an attention span read per layer, the argmaxes, the drafts).
"""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch

from peagle_trt.config import SamplingParams
from tests.helpers import make_decoder

READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "nonzero")


@contextlib.contextmanager
def counting_reads(counts: collections.Counter):
    """Count the device-to-host conversions of torch tensors made within, by name."""
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name, original):
        def read(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)
        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("mode, drafter, k", [("none", None, 0), ("eagle3", "eagle3", 3), ("peagle", "aws", 3)])
def test_one_device_read_per_step(tiny, mode, drafter, k, batch):
    dec = make_decoder(tiny, "llama", drafter, mode, k, slots=batch, deterministic=False)
    seqs = [dec.new_sequence([1, 2, 3 + i], SamplingParams(max_tokens=40, ignore_eos=True)) for i in range(batch)]
    m = dec.ex.kv.max_blocks
    for b, s in enumerate(seqs):
        s.blocks = [list(range(b * m, (b + 1) * m))]
    dec.batch = batch
    dec.prefill(seqs)
    dec.step(seqs)  # the first step after prefill drafts from the prompt's rows: measured from the next
    steps, counts = 5, collections.Counter()
    with counting_reads(counts):
        for _ in range(steps):
            dec.step(seqs)
    assert not any(s.finished for s in seqs)
    assert sum(counts.values()) == steps, dict(counts)  # one per step: the accepted tokens and counts
