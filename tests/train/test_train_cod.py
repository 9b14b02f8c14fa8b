"""COD sampling, the (anchor, depth) mask, partitioning and the draft vocabulary (the P-EAGLE paper's
recipe)."""

from __future__ import annotations

import torch

from peagle_trt.train.cod import Elements, cod_sample, mask_formula, partition, segment_rows
from peagle_trt.train.data import Corpus, draft_vocabulary


def test_cod_chains_are_contiguous_and_sized():
    n, depths, r, r_min = 200, 6, 0.7, 0.2
    mask = torch.ones(n, dtype=torch.bool)
    mask[:20] = False  # e.g. prompt tokens: not supervised
    el = cod_sample(mask, depths, r, r_min, torch.Generator().manual_seed(0))
    assert torch.equal(el.anchor[:n], torch.arange(n)) and (el.depth[:n] == 0).all()
    have = set(zip(el.anchor.tolist(), el.depth.tolist()))
    n_valid = int(mask.sum())
    for d in range(1, depths):
        at_d = [(a, dd) for a, dd in have if dd == d]
        assert 0 < len(at_d) <= int((n_valid - d) * max(r ** d, r_min))
        for a, _ in at_d:
            assert (a, d - 1) in have  # conditional on the chain existing one depth up
            assert mask[a + d]  # reference position is supervised
    assert len(el) < n * depths


def test_mask_formula_matches_inference_visibility():
    # chain (anchor 2, depth 0..2) and real rows 0..4
    el = Elements(torch.tensor([0, 1, 2, 3, 4, 2, 2, 3]), torch.tensor([0, 0, 0, 0, 0, 1, 2, 1]))
    m = mask_formula(el, el)
    assert m[5].tolist() == [True, True, True, False, False, True, False, False]  # (2,1): prefix<=2 + itself
    assert m[6].tolist() == [True, True, True, False, False, True, True, False]  # (2,2): + (2,1)
    assert m[7].tolist() == [True, True, True, True, False, False, False, True]  # another chain: not (2,*)
    assert m[3].tolist() == [True, True, True, True, False, False, False, False]  # real rows: causal


def test_partition_owns_every_element_once_and_keeps_chains_whole():
    n = 97
    el = cod_sample(torch.ones(n, dtype=torch.bool), 5, 0.7, 0.2, torch.Generator().manual_seed(1))
    parts = partition(el, n, 4)
    owned = torch.cat(parts).sort().values
    assert torch.equal(owned, torch.arange(len(el)))
    for idx in parts:
        rows, charged = segment_rows(el, idx)
        sub = el.select(rows)
        # every owned element sees all its keys inside the segment
        for i in torch.nonzero(charged).flatten().tolist():
            need = mask_formula(sub.select(torch.tensor([i])), el)[0]
            keys = set(torch.nonzero(need).flatten().tolist())
            assert keys <= set(rows.tolist())
        assert int(charged.sum()) == len(idx)


def test_draft_vocabulary_is_most_frequent_sorted_by_id():
    seq = torch.tensor([5, 5, 5, 9, 9, 1, 7, 7, 7, 7, 3])
    corpus = Corpus([seq], [torch.ones_like(seq, dtype=torch.bool)], windowed=True)
    ids = draft_vocabulary(corpus, 12, 3)
    assert ids.tolist() == [5, 7, 9]
    d2t = ids - torch.arange(3)
    assert (torch.arange(3) + d2t).tolist() == [5, 7, 9]
