"""PEagleKVAttention with a tree mask (ops.reference): each tree row computes exactly what the plain
op computes for the chain of its ancestors (same positions), the rows write their own KV slots
(positions[b, 0] + s), and a causal mask gives the plain op."""

from __future__ import annotations

import pytest
import torch

from peagle_trt.ops import reference
from peagle_trt.ops.reference import causal_tree_mask, pack_tree_mask
from peagle_trt.speculative.tree import chain, depths

H, KV, D, BS = 4, 2, 8, 4


def _case(gen, cur: list[int], rows: int):
    b = len(cur)
    m = (max(cur) + rows) // BS + 2
    tables = torch.arange(b * m).view(b, m)
    kc = torch.randn(b * m + 1, BS, KV, D, generator=gen)
    vc = torch.randn(b * m + 1, BS, KV, D, generator=gen)
    q = torch.randn(b, rows, H * D, generator=gen)
    k = torch.randn(b, rows, KV * D, generator=gen)
    v = torch.randn(b, rows, KV * D, generator=gen)
    return tables, kc, vc, q, k, v


def test_every_tree_row_equals_the_chain_of_its_ancestors():
    gen = torch.Generator().manual_seed(0)
    trees = [(-1, -1, 0, 0, 2, 1), (-1, 0, 1)]  # 6 nodes; 3 nodes (a chain) and padding
    cur, rows = [9, 3], 7
    tables, kc, vc, q, k, v = _case(gen, cur, rows)
    positions = torch.full((2, rows), -1)
    for b, parents in enumerate(trees):
        positions[b, :len(parents) + 1] = torch.tensor([cur[b]] + [cur[b] + d for d in depths(parents)])
    mask = torch.from_numpy(pack_tree_mask(trees, rows))
    kt, vt = kc.clone(), vc.clone()
    out = reference.kv_attention(q, k, v, positions, tables, kt, vt, H, KV, D, tree_mask=mask)
    for b, parents in enumerate(trees):
        for n in range(len(parents)):
            path = [n]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            idx = torch.tensor([0] + [p + 1 for p in reversed(path)])  # root, ancestors, the node
            kp, vp = kc.clone(), vc.clone()
            want = reference.kv_attention(q[b:b + 1, idx], k[b:b + 1, idx], v[b:b + 1, idx],
                                          cur[b] + torch.arange(len(idx))[None], tables[b:b + 1], kp, vp, H, KV, D)
            torch.testing.assert_close(out[b, n + 1], want[0, -1])
        # the rows wrote their own slots cur + s; nothing past them
        for s in range(len(parents) + 1):
            slot = cur[b] + s
            torch.testing.assert_close(kt[tables[b, slot // BS], slot % BS], k[b, s].view(KV, D))
        slot = cur[b] + len(parents) + 1
        torch.testing.assert_close(kt[tables[b, slot // BS], slot % BS], kc[tables[b, slot // BS], slot % BS])


def test_a_causal_mask_is_the_plain_op():
    gen = torch.Generator().manual_seed(1)
    tables, kc, vc, q, k, v = _case(gen, [5, 12], 5)
    positions = torch.tensor([[5, 6, 7, 8, 9], [12, 13, 14, -1, -1]])
    for window in (0, 3):
        plain = reference.kv_attention(q, k, v, positions, tables, kc.clone(), vc.clone(), H, KV, D,
                                       sliding_window=window)
        masked = reference.kv_attention(q, k, v, positions, tables, kc.clone(), vc.clone(), H, KV, D,
                                        sliding_window=window, tree_mask=torch.from_numpy(causal_tree_mask(2, 5)))
        live = positions >= 0
        torch.testing.assert_close(masked[live], plain[live])


def test_packed_bits_past_32_rows():
    mask = pack_tree_mask([chain(39)], 40)  # 40 rows: two words
    assert mask.shape == (1, 40, 2) and mask.dtype.name == "int32"
    assert mask[0, 0].tolist() == [1, 0] and mask[0, 31].tolist() == [-1, 0] and mask[0, 39].tolist() == [-1, 255]


@pytest.mark.parametrize("rows", [1, 5, 31, 32, 33, 64, 70])
def test_causal_mask_on_the_device_equals_the_host_one(rows):
    """The TensorRT executor's plain-verify mask, built by tensor ops where the rows are (no host copy)."""
    got = reference.causal_tree_mask_on(3, rows, torch.device("cpu"))
    assert got.dtype == torch.int32 and got.is_contiguous()
    assert torch.equal(got, torch.from_numpy(causal_tree_mask(3, rows)))
