"""The onnxruntime executor made in memory (`OrtExecutor.from_models`, what `generate --target`
runs on CPU): logits near the torch reference, and the KV cache written in place: the new rows
land in the very buffers bound as past_* / present_* (IO binding), in the blocks the block
table names at their offsets only, with no other cache entry touched; spec == target-only
within it; every session on the process's one thread pool."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from peagle_trt.checkpoint import load_pair
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError
from peagle_trt.executors import onnxruntime as ort_executor
from peagle_trt.executors.onnxruntime import OrtExecutor
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.runtime.scheduler import generate
from peagle_trt.speculative.decoder import SpecDecoder

LOGIT_TOL = 1e-4  # as tests/export/test_onnx.py


def test_in_memory_executor_writes_kv_in_place(tiny):
    target, _ = load_pair(tiny["llama"], None, SpecConfig("none", 0)).build()
    ort_ex, torch_ex = OrtExecutor.from_models(target, None, None, 2, 64), TorchExecutor(target, None, 2, 64)
    kv = ort_ex.g_target.kv
    addresses = {name: a.ctypes.data for name, a in kv.items()}
    tables = torch.tensor([[[3, -1]]])  # [G, B, M]: one request, positions 0..31 in block 3
    for tokens, positions in (([[5, 6, 7]], [[0, 1, 2]]), ([[9]], [[3]]), ([[4, 8]], [[4, 5]])):
        got, _ = ort_ex.target(torch.tensor(tokens), torch.tensor(positions), tables)  # [1, S, V]
        want, _ = torch_ex.target(torch.tensor(tokens), torch.tensor(positions), tables)
        assert (got - want).abs().max() < LOGIT_TOL
    assert {name: a.ctypes.data for name, a in kv.items()} == addresses  # the same buffers, still bound
    k0 = kv["past_key_0"]  # [blocks + 1, block_size, KV, d]
    np.testing.assert_allclose(k0[3, :6], torch_ex.target_cache.k[0][3, :6].numpy(), atol=1e-5)
    assert k0[3, :6].any() and not k0[3, 6:].any()  # later offsets untouched
    assert not np.delete(k0, 3, axis=0).any()  # every other block untouched


def test_in_memory_spec_equals_target_only(tiny):
    spec = SpecConfig("peagle", 3)
    target, drafter = load_pair(tiny["llama"], tiny["aws"], spec).build()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = list(range(7, 30))
    spec_ex = OrtExecutor.from_models(target, drafter, spec, 1, 64, deterministic=True)
    spec_out = generate(SpecDecoder(spec_ex, spec), prompt, params)
    none = SpecConfig("none", 3)
    plain_ex = OrtExecutor.from_models(target, None, None, 1, 64, deterministic=True)
    plain = generate(SpecDecoder(plain_ex, none), prompt, params)
    assert spec_out.output == plain.output and len(plain.output) == 12


def test_target_and_drafter_sessions_share_one_thread_pool(tiny):
    """Per-session pools spin after their run and slow the next graph down (the module docstring):
    every session uses the process's pool, which cannot be resized afterwards."""
    spec = SpecConfig("peagle", 3)
    target, drafter = load_pair(tiny["llama"], tiny["aws"], spec).build()
    ex = OrtExecutor.from_models(target, drafter, spec, 1, 64)
    graphs = [ex.g_target, ex.g_drafter, ex.g_step, ex.g_fc]
    assert all(not g.session.get_session_options().use_per_session_threads for g in graphs)
    made = ort_executor._POOL["threads"]
    OrtExecutor.from_models(target, None, None, 1, 64, threads=made)  # the same count (or none): fine
    with pytest.raises(ConfigError, match="thread pool"):
        OrtExecutor.from_models(target, None, None, 1, 64, threads=(made or 0) + 1)
