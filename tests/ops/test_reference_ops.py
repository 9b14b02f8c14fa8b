"""The custom ops' torch references against naive per-row loops (the contract for ONNX and plugins)."""

from __future__ import annotations

import math

import pytest
import torch

from peagle_trt.ops import draft_inputs, draft_sample, kv_attention


def naive_attention(q, k, v, positions, slots, k_cache, v_cache, h, kv, d):
    b, s, _ = q.shape
    out = torch.zeros(b, s, h * d)
    for i in range(b):
        for j in range(s):
            p = int(positions[i, j])
            if p >= 0:
                k_cache[slots[i], :, p] = k[i, j].view(kv, d)
                v_cache[slots[i], :, p] = v[i, j].view(kv, d)
    for i in range(b):
        for j in range(s):
            p = int(positions[i, j])
            if p < 0:
                continue
            for head in range(h):
                g = head // (h // kv)
                keys, vals = k_cache[slots[i], g, :p + 1], v_cache[slots[i], g, :p + 1]
                w = torch.softmax(keys @ q[i, j, head * d:(head + 1) * d] / math.sqrt(d), dim=0)
                out[i, j, head * d:(head + 1) * d] = w @ vals
    return out


@pytest.mark.parametrize("h,kv,d", [(4, 2, 8), (2, 2, 16), (8, 1, 4)])
def test_kv_attention_matches_naive_loop(h, kv, d):
    n_slots, t, b, s = 4, 40, 3, 5
    base = torch.randn(n_slots, kv, t + 1, d)
    k_cache, v_cache = base.clone(), torch.randn_like(base)
    k2, v2 = k_cache.clone(), v_cache.clone()
    q, k, v = torch.randn(b, s, h * d), torch.randn(b, s, kv * d), torch.randn(b, s, kv * d)
    positions = torch.tensor([[10, 11, 12, 13, 14], [0, 1, 2, -1, -1], [30, 31, 32, 33, -1]])
    slots = torch.tensor([2, 0, 3])
    out = kv_attention(q, k, v, positions, slots, k_cache, v_cache, h, kv, d)
    ref = naive_attention(q, k, v, positions, slots, k2, v2, h, kv, d)
    valid = positions >= 0
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache[:, :, :t], k2[:, :, :t])  # same writes (trash row excluded)
    torch.testing.assert_close(v_cache[:, :, :t], v2[:, :, :t])
    assert torch.equal(k_cache[1], base[1])  # an untouched slot stays untouched


def test_draft_inputs_layout_worked_example():
    h, k, mask = 4, 3, 99
    embed = torch.randn(100, h)
    h_mask = torch.randn(h)
    tokens = torch.tensor([[5, 6, 0], [7, 8, 9]])  # request 0 has n=2 pending rows, request 1 n=3
    hidden = torch.randn(2, 3, h)
    n, cur = torch.tensor([2, 3]), torch.tensor([12, 40])
    e, g, pos, rows = draft_inputs(tokens, hidden, n, cur, embed, h_mask, k, mask)
    assert e.shape == (2, 5, h) and pos.tolist() == [[10, 11, 12, 13, -1], [37, 38, 39, 40, 41]]
    assert rows.tolist() == [[1, 2, 3], [2, 3, 4]]
    torch.testing.assert_close(e[0, :4], embed[[5, 6, mask, mask]])
    torch.testing.assert_close(g[0, :2], hidden[0, :2])
    torch.testing.assert_close(g[0, 2:4], h_mask.expand(2, -1))
    assert torch.all(e[0, 4] == 0) and torch.all(g[0, 4] == 0)  # padding row
    torch.testing.assert_close(e[1], embed[[7, 8, 9, mask, mask]])


def test_draft_sample_maps_through_d2t():
    logits = torch.tensor([[[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]]])
    d2t = torch.tensor([10, 20, 30])
    assert draft_sample(logits, d2t).tolist() == [[21, 10]]
