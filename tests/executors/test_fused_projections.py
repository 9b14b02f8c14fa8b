"""`TorchExecutor(fuse=True)` (the default on CUDA): q/k/v and gate/up as one matmul each
(peagle_trt/models/layers.py `fuse_projections`), checked on the CPU.

What it checks: the fused target's logits and taps equal the unfused one's to rounding; greedy
speculative output equals target-only output on the fused models (deterministic mode: exact by
construction); fusing is idempotent and leaves FP8 projections (their own scales) and KV-shared or
k-as-v attention alone.
"""

from __future__ import annotations

import torch
from torch import nn

from peagle_trt.checkpoint import load_pair
from peagle_trt.config import SpecConfig
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.models.fp8 import FP8Linear
from peagle_trt.models.layers import MLP, Attention, fuse_projections
from peagle_trt.runtime.scheduler import generate
from peagle_trt.speculative.decoder import SpecDecoder
from tests.helpers import greedy


def _models(tiny, spec):
    return load_pair(tiny["llama"], tiny["aws"], spec).build()


def test_fused_forward_matches_and_speculation_stays_exact(tiny):
    spec = SpecConfig("peagle", 3)
    t0, d0 = _models(tiny, spec)
    t1, d1 = _models(tiny, spec)
    plain = TorchExecutor(t0, d0, 1, 128)
    fused = TorchExecutor(t1, d1, 1, 128, fuse=True)
    assert all(hasattr(m, "qkv_proj") and not hasattr(m, "q_proj") for m in t1.modules() if isinstance(m, Attention))
    assert all(hasattr(m, "gate_up_proj") for m in t1.modules() if isinstance(m, MLP))
    ids = torch.tensor([[5, 17, 99, 3, 42, 7, 250, 8]])
    pos = torch.arange(ids.shape[1])[None]
    want, aux_want = plain.target(ids, pos, torch.tensor([[0]]))
    got, aux = fused.target(ids, pos, torch.tensor([[0]]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux, aux_want, atol=1e-5, rtol=1e-5)
    assert fuse_projections(t1) == 0  # already fused

    t2, d2 = _models(tiny, spec)
    exact = SpecDecoder(TorchExecutor(t2, d2, 1, 128, deterministic=True, fuse=True), spec)
    t3, _ = _models(tiny, SpecConfig("none", 0))
    target_only = SpecDecoder(TorchExecutor(t3, None, 1, 128, deterministic=True, fuse=True), SpecConfig("none", 0))
    for prompt in ([5, 17, 99, 3, 42], [300, 1, 2]):
        assert generate(exact, prompt, greedy(16)).output == generate(target_only, prompt, greedy(16)).output


def test_fp8_and_shared_projections_stay_apart():
    attn = Attention(32, 32, 4, 2, 8)
    attn.k_proj = FP8Linear(32, 16)  # its own per-tensor scales: not stackable
    assert not attn.fuse() and hasattr(attn, "q_proj")
    shared = Attention(32, 32, 4, 2, 8, kv_shared=True)
    k_is_v = Attention(32, 32, 4, 2, 8, k_eq_v=True)
    assert not shared.fuse() and not k_is_v.fuse()
    mlp = MLP(32, 64)
    x = torch.randn(3, 32)
    want = mlp(x)
    assert mlp.fuse() and isinstance(mlp.gate_up_proj, nn.Linear) and not mlp.fuse()
    torch.testing.assert_close(mlp(x), want)
