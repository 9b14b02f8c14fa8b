"""The training forward against the inference model: same logits for every chain element
(mask correctness), and partitioned loss/gradient equal to the flat ones."""

from __future__ import annotations

import pytest
import torch

from peagle_trt.checkpoint import load_target
from peagle_trt.models.target import TargetModel
from peagle_trt.train import TrainConfig
from peagle_trt.train.cod import cod_sample, partition
from peagle_trt.train.data import target_features, target_pass
from peagle_trt.train.forward import segment_forward, segment_loss
from peagle_trt.train.loop import build_head

N_LAYERS_HEAD = 2


@pytest.fixture(scope="module")
def setup(tiny):
    ckpt = load_target(tiny["llama"])
    taps = (1, 3, 5)
    target = TargetModel.from_tensors(ckpt.config, ckpt.tensors, taps)
    torch.manual_seed(0)
    ids = torch.randint(0, ckpt.config.vocab_size, (40,))
    draft_ids = torch.arange(0, ckpt.config.vocab_size, 2)
    feats = target_features(target, ids, torch.ones_like(ids, dtype=torch.bool), draft_ids)
    return ckpt, taps, feats, draft_ids


def _head(setup, method):
    ckpt, taps, _, draft_ids = setup
    cfg = TrainConfig(target=ckpt.path, output=ckpt.path, method=method, text=("x",), layers=N_LAYERS_HEAD)
    head, _ = build_head(cfg, ckpt, taps, 3, draft_ids)
    with torch.no_grad():  # non-trivial norms and mask_hidden
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(1 + 0.3 * torch.randn_like(p))
    return head


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_training_forward_equals_inference(setup, method):
    """Each element (a, d) gets the logits the inference model computes for draft slot d after
    real rows 0..a: P-EAGLE with mask rows in one pass, EAGLE-3 by sequential passes."""
    _, _, f, _ = setup
    head = _head(setup, method)
    model = head.model
    el = cod_sample(f.loss_mask, 4, 0.7, 0.2, torch.Generator().manual_seed(3))
    with torch.no_grad():
        sub, x, _ = segment_forward(head, f, el, torch.arange(len(el)), 3)
        logits = model.logits(x)
    chains = [a for a, d in zip(sub.anchor.tolist(), sub.depth.tolist()) if d == 3][:3]
    assert chains, "COD sampled no depth-3 chain"
    for a in chains:
        cache = model.new_cache(1, 64)
        slots = torch.zeros(1, dtype=torch.long)
        with torch.no_grad():
            e = model.embed_tokens(f.tokens[:a + 1])
            g = model.project(f.aux[:a + 1])
            if head.parallel:
                e = torch.cat([e, model.embed_tokens.weight[3].expand(3, -1)])
                g = torch.cat([g, model.project(head.mask_hidden.reshape(1, -1)).expand(3, -1)])
                x = model.forward_rows(e[None], g[None], torch.arange(a + 4)[None], slots, cache)[0]
                want = model.logits(x[a:a + 4])
            else:
                x = model.forward_rows(e[None], g[None], torch.arange(a + 1)[None], slots, cache)[0]
                rows, prev = [x[a]], x[a]
                for d in range(1, 4):
                    tok = f.tokens[a + d:a + d + 1]
                    prev = model.forward_rows(model.embed_tokens(tok)[None], prev[None, None],
                                              torch.tensor([[a + d]]), slots, cache)[0, 0]
                    rows.append(prev)
                want = model.logits(torch.stack(rows))
        for d in range(4):
            i = next(i for i, (aa, dd) in enumerate(zip(sub.anchor.tolist(), sub.depth.tolist()))
                     if aa == a and dd == d)
            torch.testing.assert_close(logits[i], want[d], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_partitioned_loss_and_gradient_equal_flat(setup, method):
    _, _, f, _ = setup
    el = cod_sample(f.loss_mask, 5, 0.7, 0.2, torch.Generator().manual_seed(5))
    normaliser = float(f.loss_mask[el.position].sum())
    results = []
    for segments in (1, 4):
        head = _head(setup, method)
        total = 0.0
        for owned in partition(el, len(f.tokens), segments):
            if owned.numel():
                loss = segment_loss(head, f, el, owned, 3, normaliser)
                loss.backward()
                total += float(loss.detach())
        grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
        results.append((total, grads))
    (flat, g1), (split, g4) = results
    assert flat > 0
    assert split == pytest.approx(flat, rel=1e-5)
    assert g1.keys() == g4.keys() and len(g1) > 5
    for name in g1:
        torch.testing.assert_close(g4[name], g1[name], atol=1e-6, rtol=1e-4, msg=name)


def test_target_features_in_chunks_equal_one_pass(setup):
    ckpt, taps, f, draft_ids = setup
    target = TargetModel.from_tensors(ckpt.config, ckpt.tensors, taps)
    torch.manual_seed(0)
    ids = torch.randint(0, ckpt.config.vocab_size, (40,))
    chunked = target_features(target, ids, torch.ones_like(ids, dtype=torch.bool), draft_ids, chunk=7)
    torch.testing.assert_close(chunked.aux, f.aux, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked.probs, f.probs, atol=1e-6, rtol=1e-4)
    assert torch.equal(chunked.tokens, f.tokens) and torch.equal(chunked.loss_mask, f.loss_mask)


def test_lazy_probs_equal_the_eager_ones(setup):
    """Each partition's target distribution made from the kept hidden state (`probs_at`) is the one
    the whole-sequence softmax gave (the eager [N, V_d] table the features used to hold)."""
    ckpt, taps, f, draft_ids = setup
    target = TargetModel.from_tensors(ckpt.config, ckpt.tensors, taps)
    torch.manual_seed(0)
    ids = torch.randint(0, ckpt.config.vocab_size, (40,))
    normed, _ = target_pass(target, ids)
    eager = torch.softmax(target.head_logits(normed[1:], draft_ids), dim=-1)  # [N, V_d]
    assert f.normed.shape == (39, ckpt.config.hidden_size)  # O(N * H) kept, no [N, V_d] table
    el = cod_sample(f.loss_mask, 5, 0.7, 0.2, torch.Generator().manual_seed(5))
    for owned in partition(el, len(f.tokens), 4):
        pos = el.select(owned).position
        torch.testing.assert_close(f.probs_at(pos), eager[pos], atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(f.probs, eager, atol=1e-7, rtol=1e-6)
    again = target_features(target, ids, torch.ones_like(ids, dtype=torch.bool), draft_ids)
    shorter = target_features(target, ids[:9], again.loss_mask[:9], draft_ids)
    assert again.lm_rows.data_ptr() == shorter.lm_rows.data_ptr()  # gathered once, shared


def test_recomputed_context_gives_the_same_loss_and_gradient(setup):
    """Partitions with their depth-0 context in checkpointed blocks (recomputed in backward) train as without."""
    _, _, f, _ = setup
    el = cod_sample(f.loss_mask, 5, 0.7, 0.2, torch.Generator().manual_seed(7))
    normaliser = float(f.loss_mask[el.position].sum())
    results = []
    for recompute in (0, 6):  # blocks of 6 positions: a segment's context (up to 39) in up to 7 blocks
        head = _head(setup, "peagle")
        losses = []
        for owned in partition(el, len(f.tokens), 4):
            if owned.numel():
                loss = segment_loss(head, f, el, owned, 3, normaliser, recompute=recompute)
                loss.backward()
                losses.append(float(loss.detach()))
        results.append((losses, {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}))
    (plain_loss, plain), (again_loss, recomputed) = results
    assert again_loss == pytest.approx(plain_loss, rel=1e-6) and len(plain_loss) == 4
    assert plain.keys() == recomputed.keys() and len(plain) > 5
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], atol=1e-7, rtol=1e-5, msg=name)
        assert not torch.equal(plain[name], torch.zeros_like(plain[name])), name
