"""The speculative step waits on the device ONCE per step: one host-to-device upload
(the verify's host ints, non-blocking: peagle_trt/speculative/drafting.py `upload`) and one
device-to-host read (the accepted tokens and counts); everything after the read is host bookkeeping.

Reads: every tensor-to-host conversion during `SpecDecoder.step` (tolist, item, int, float, bool,
index, cpu, nonzero: on a GPU each one waits for the device). Not counted: `.numpy()`, which a
device tensor refuses (it needs `.cpu()` first, counted); the step's CPU argmax reads a host
tensor's numpy view.
Uploads: every tensor made from host data (torch.tensor, as_tensor, asarray, from_numpy,
frombuffer, Tensor.new_tensor: on a GPU a synchronous copy), one per call of `upload` (what it
makes inside is its one copy). Not counted: `accept.argmax` on CPU, which wraps numpy's argmax of
host logits (host in, host out; on a GPU it is `logits.argmax`).
Ops: no aten op whose output shape or value the host must wait for (nonzero, masked_select, a bool
index, unique, repeat_interleave without output_size, item) runs inside the step, its forwards
included (a TorchDispatchMode sees every op).
At batch 1 and 8, every spec mode, trees and grammar off, the torch executor on CPU (attention
spans come from the host, ops.reference.key_span), dense and MoE targets; a request that finishes mid-batch adds one
non-blocking upload (which requests go on) and no read; a tree adds one read (the drafter's top
candidates: the tree is chosen on the host).
Before the step moved to the device the read count gave 9 (none), 16 (eagle3 K = 3) and 12 (peagle K = 3) per step
(batch 1 and 8 alike: an attention span read per layer, the argmaxes, the drafts); before the
one upload, the step made 4 synchronous uploads (last tokens, drafts per request twice, tables).
"""

from __future__ import annotations

import collections
import contextlib
import sys
from unittest import mock

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.speculative import accept, drafting
from tests.helpers import make_decoder

READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "nonzero")
HOST_DATA = ("tensor", "as_tensor", "asarray", "from_numpy", "frombuffer")  # torch.* made from host data
MODES = [("none", None, 0), ("eagle3", "eagle3", 3), ("peagle", "aws", 3)]


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


@contextlib.contextmanager
def counting_uploads(counts: collections.Counter):
    """Count the tensors made from host data within, by constructor name; a call of `upload`
    counts once ("upload"), and what it or the CPU argmax makes inside is not counted again."""
    inside = [0]  # depth of the scopes whose constructions are not counted

    def constructor(name, original):
        def make(*args, **kwargs):
            if not inside[0]:
                counts[name] += 1
            return original(*args, **kwargs)
        return make

    def scope(name, original):
        def call(*args, **kwargs):
            if name and not inside[0]:
                counts[name] += 1
            inside[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                inside[0] -= 1
        return call

    with contextlib.ExitStack() as stack:
        for name in HOST_DATA:
            stack.enter_context(mock.patch.object(torch, name, constructor(name, getattr(torch, name))))
        stack.enter_context(mock.patch.object(torch.Tensor, "new_tensor", constructor("new_tensor",
                                                                                      torch.Tensor.new_tensor)))
        upload = drafting.upload
        for module in [m for n, m in sys.modules.items() if n.startswith("peagle_trt")]:  # every importer
            if getattr(module, "upload", None) is upload:
                stack.enter_context(mock.patch.object(module, "upload", scope("upload", upload)))
        # host logits in, host argmax out (numpy's, single-threaded): no upload; on a GPU logits.argmax
        stack.enter_context(mock.patch.object(accept, "argmax", scope(None, accept.argmax)))
        yield counts


def data_dependent(func, args, kwargs) -> bool:
    """An aten op whose output shape or value the host must wait for on a GPU."""
    name = func.overloadpacket.__name__
    if name in ("nonzero", "masked_select", "_local_scalar_dense", "item") or "unique" in name:
        return True
    if name == "repeat_interleave":  # tensor repeats (not self_int: an int count, e.g. GQA with sinks)
        return kwargs.get("output_size") is None and func._overloadname != "self_int"
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):  # a bool index: nonzero inside
        return any(i is not None and i.dtype == torch.bool for i in args[1])
    return False


class DataDependentOps(TorchDispatchMode):
    """Records the data-dependent aten ops (`data_dependent`) run within."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if data_dependent(func, args, kwargs):
            self.seen[str(func)] += 1
        return func(*args, **kwargs)


def decoding(tiny, mode, drafter, k, batch, max_tokens=(), spec=None, target="llama"):
    """A decoder and `batch` prefilled requests past their first step (which drafts from the
    prompt's rows); `max_tokens[i]` (else 40) for request i. `target`: a key of `tiny` (a MoE
    target of tiny_moe, with its head as `drafter`)."""
    dec = make_decoder(tiny, target, drafter, mode, k, slots=batch, deterministic=False, spec=spec)
    limits = list(max_tokens) + [40] * (batch - len(max_tokens))
    seqs = [dec.new_sequence([1, 2, 3 + i], SamplingParams(max_tokens=limits[i], ignore_eos=True))
            for i in range(batch)]
    m = dec.ex.kv.max_blocks
    for b, s in enumerate(seqs):
        s.blocks = [list(range(b * m, (b + 1) * m))]
    dec.batch = batch
    dec.prefill(seqs)
    dec.step(seqs)
    return dec, seqs


def counted_steps(dec, seqs, steps: int) -> list[tuple[collections.Counter, collections.Counter, int]]:
    """Per step: (uploads, reads, requests that finished in it while others went on)."""
    out = []
    for _ in range(steps):
        uploads, reads, running = collections.Counter(), collections.Counter(), sum(not s.finished for s in seqs)
        with counting_uploads(uploads), counting_reads(reads):
            dec.step(seqs)
        left = sum(not s.finished for s in seqs)
        out.append((uploads, reads, running - left if left else 0))
    return out


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("mode, drafter, k", MODES)
def test_one_upload_and_one_read_per_step(tiny, mode, drafter, k, batch):
    dec, seqs = decoding(tiny, mode, drafter, k, batch)
    for uploads, reads, _ in counted_steps(dec, seqs, 5):
        assert dict(uploads) == {"upload": 1}, dict(uploads)  # the verify's host ints
        assert sum(reads.values()) == 1, dict(reads)  # the accepted tokens and counts
    assert not any(s.finished for s in seqs)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("mode, drafter, k", MODES)
def test_a_request_finishing_mid_batch(tiny, mode, drafter, k, batch):
    """Request 0 stops at 6 tokens: the step it finishes in drafts for the others (a subset of the
    verify's rows, by an index uploaded without blocking) and reads the device once."""
    dec, seqs = decoding(tiny, mode, drafter, k, batch, max_tokens=[6])
    counts = counted_steps(dec, seqs, 6)
    assert seqs[0].finished and all(not s.finished for s in seqs[1:])
    assert sum(finished for *_, finished in counts) == (batch > 1)  # the case happened (batch 8)
    for uploads, reads, finished in counts:
        if sum(uploads.values()) or sum(reads.values()):  # (steps after batch 1's request finished: none)
            drafted = finished and dec.num_spec_tokens
            assert dict(uploads) == {"upload": 1 + bool(drafted)}, dict(uploads)
            assert sum(reads.values()) == 1, dict(reads)


def test_a_tree_step_reads_its_candidates(tiny):
    """A tree's step: the same one upload (its parents, depths and mask with the rest); a second
    read brings the drafter's top candidates (ids and log-probs, one copy) to the host, which
    chooses the tree."""
    dec, seqs = decoding(tiny, "peagle", "aws", 3, 4, spec=SpecConfig("peagle", 3, tree_budget=4))
    for uploads, reads, _ in counted_steps(dec, seqs, 4):
        assert dict(uploads) == {"upload": 1}, dict(uploads)
        assert dict(reads) == {"tolist": 1, "cpu": 1}, dict(reads)  # the verdict; ids and log-probs in one


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("mode, drafter, k", MODES)
def test_no_data_dependent_op_in_the_step(tiny, mode, drafter, k, batch):
    """Every aten op of the step (forwards included) has a host-known output shape, and none reads
    a value back: nothing waits for the device but the one read (finishing and tree steps too)."""
    cases = [decoding(tiny, mode, drafter, k, batch, max_tokens=[6])]
    if mode == "peagle":
        cases.append(decoding(tiny, mode, drafter, k, batch, spec=SpecConfig("peagle", 3, tree_budget=4)))
    for dec, seqs in cases:
        ops = DataDependentOps()
        with ops:
            for _ in range(6):
                dec.step(seqs)
        assert not ops.seen, dict(ops.seen)


MOE_CASES = [("none", False, 0, 1), ("eagle3", True, 3, 1), ("peagle", True, 3, 1), ("peagle", True, 3, 8)]


@pytest.mark.parametrize("mode, head, k, batch", MOE_CASES)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_moe_targets_read_once_per_step(tiny_moe, family, mode, head, k, batch):
    """MoE targets too: the CPU path of the MoE layers (peagle_trt/ops/reference.py `moe`) sees the
    routing through numpy views of CPU tensors, so the step keeps its one upload and one read, and
    no data-dependent op runs in it (before: 7 reads a step on the tiny Qwen3-MoE, 9 on GPT-OSS)."""
    drafter = f"drafter-{family}" if head else None
    dec, seqs = decoding(tiny_moe, mode, drafter, k, batch, target=family)
    for uploads, reads, _ in counted_steps(dec, seqs, 3):
        assert dict(uploads) == {"upload": 1}, dict(uploads)
        assert sum(reads.values()) == 1, dict(reads)
    ops = DataDependentOps()
    with ops:
        dec.step(seqs)
    assert not ops.seen, dict(ops.seen)


def test_upload_packs_its_parts_in_one_buffer():
    """Off the CPU, `upload` copies one flat buffer (its parts one after another) and views it."""
    parts = [np.arange(6).reshape(2, 3), [[7, 8]], np.zeros((2, 0), np.int64), np.full((1, 2, 4), -1)]
    arrays = [np.asarray(p, dtype=np.int64) for p in parts]
    flat = drafting.packed(arrays, pin=False)
    assert flat.shape == (6 + 2 + 0 + 8,)
    out = drafting.views(flat, arrays)
    assert [o.tolist() for o in out] == [a.tolist() for a in arrays]
    assert all(o.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for o in out)
    moved = drafting.upload(parts, "meta")  # the device path (a meta tensor has no values): shapes
    assert [(t.device.type, t.dtype, tuple(t.shape)) for t in moved] == [("meta", torch.int64, a.shape) for a in arrays]
