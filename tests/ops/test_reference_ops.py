"""The custom ops' torch references against naive per-row loops (the contract for ONNX and plugins)."""

from __future__ import annotations

import math

import pytest
import torch

from peagle_trt.ops import draft_inputs, draft_sample, kv_attention


def naive_attention(q, k, v, positions, tables, k_cache, v_cache, h, kv, d, window=0):
    """Row by row, position by position: the paged contract spelled out."""
    b, s, _ = q.shape
    bs = k_cache.shape[1]

    def where(i, p):  # (block, offset) of position p of request i
        return int(tables[i, p // bs]), p % bs

    out = torch.zeros(b, s, h * d)
    for i in range(b):
        for j in range(s):
            p = int(positions[i, j])
            if p >= 0:
                k_cache[where(i, p)] = k[i, j].view(kv, d)
                v_cache[where(i, p)] = v[i, j].view(kv, d)
    for i in range(b):
        for j in range(s):
            p = int(positions[i, j])
            if p < 0:
                continue
            seen = [x for x in range(p + 1) if not window or x > p - window]
            for head in range(h):
                g = head // (h // kv)
                keys = torch.stack([k_cache[where(i, x)][g] for x in seen])
                vals = torch.stack([v_cache[where(i, x)][g] for x in seen])
                w = torch.softmax(keys @ q[i, j, head * d:(head + 1) * d] / math.sqrt(d), dim=0)
                out[i, j, head * d:(head + 1) * d] = w @ vals
    return out


@pytest.mark.parametrize("h,kv,d,window", [(4, 2, 8, 0), (2, 2, 16, 0), (8, 1, 4, 0), (4, 2, 8, 6)])
def test_kv_attention_matches_naive_loop(h, kv, d, window):
    blocks, bs, m, b, s = 16, 4, 10, 3, 5
    base = torch.randn(blocks + 1, bs, kv, d)  # + the trash block
    k_cache, v_cache = base.clone(), torch.randn_like(base)
    k2, v2 = k_cache.clone(), v_cache.clone()
    q, k, v = torch.randn(b, s, h * d), torch.randn(b, s, kv * d), torch.randn(b, s, kv * d)
    positions = torch.tensor([[10, 11, 12, 13, 14], [0, 1, 2, -1, -1], [30, 31, 32, 33, -1]])
    tables = torch.full((b, m), -1)  # scattered blocks, -1 past each request's end
    tables[0, :4] = torch.tensor([7, 2, 12, 5])
    tables[1, :1] = torch.tensor([9])
    tables[2, :9] = torch.tensor([0, 1, 3, 4, 6, 8, 10, 11, 13])
    if window:  # a windowed group gives back the blocks wholly before p - W + 1
        tables[2, :6] = -1
    out = kv_attention(q, k, v, positions, tables, k_cache, v_cache, h, kv, d, sliding_window=window)
    ref = naive_attention(q, k, v, positions, tables, k2, v2, h, kv, d, window)
    valid = positions >= 0
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache[:blocks], k2[:blocks])  # same writes (trash block excluded)
    torch.testing.assert_close(v_cache[:blocks], v2[:blocks])
    assert torch.equal(k_cache[14], base[14]) and torch.equal(k_cache[15], base[15])  # blocks nobody holds


@pytest.mark.parametrize("table", [[3, 4, 5, 6, -1], [6, 3, 5, 4, -1]])  # consecutive blocks: read as a view
@pytest.mark.parametrize("positions", [[13], [11, 12, 13, 14], [13, -1]])  # decode (no mask), verify, padding
def test_kv_attention_one_request_matches_naive_loop(table, positions):
    h, kv, d, bs = 6, 2, 8, 4
    k_cache, v_cache = torch.randn(8, bs, kv, d), torch.randn(8, bs, kv, d)
    k2, v2 = k_cache.clone(), v_cache.clone()
    s = len(positions)
    q, k, v = torch.randn(1, s, h * d), torch.randn(1, s, kv * d), torch.randn(1, s, kv * d)
    positions, tables = torch.tensor([positions]), torch.tensor([table])
    out = kv_attention(q, k, v, positions, tables, k_cache, v_cache, h, kv, d)
    ref = naive_attention(q, k, v, positions, tables, k2, v2, h, kv, d)
    valid = positions >= 0
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache[:7], k2[:7])


def test_kv_attention_sends_rows_past_the_table_to_the_trash_block():
    base = torch.randn(3, 4, 1, 2)  # blocks 0, 1 + trash
    k_cache, v_cache = base.clone(), base.clone()
    tables = torch.tensor([[0, 1]])  # M = 2: positions 0..7
    q, k, v = torch.randn(1, 2, 2), torch.randn(1, 2, 2), torch.randn(1, 2, 2)
    kv_attention(q, k, v, torch.tensor([[7, 8]]), tables, k_cache, v_cache, 1, 1, 2)  # 8: past the table
    torch.testing.assert_close(k_cache[1, 3, 0], k[0, 0])  # position 7 -> block 1, offset 3
    torch.testing.assert_close(k_cache[2, 0, 0], k[0, 1])  # position 8 -> the trash block
    assert torch.equal(k_cache[0], base[0])


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
