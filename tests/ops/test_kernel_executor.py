"""The torch executor on the Triton kernels (`TorchExecutor(kernels="cuda")`), rehearsed on the CPU under
Triton's interpreter (`ops.kernels.rehearsal()`): every kernel the GPU executor launches (KV attention
split and unsplit, RMSNorm, RoPE, the drafter's input assembly and sampling) in the real model path, so
what can fail on a CPU fails here before a GPU window (tests/plugins/test_executor_gpu.py is the same
check on the GPU).

What it checks (tiny Llama + its P-EAGLE head, fp32): the kernel executor's prefill logits against the
reference ops' (tolerance); drafts that are the target's own greedy tokens are all accepted and the
output equals target-only output on the same kernels; the real head's speculative output equals
target-only output, or where they part the target's top-2 there are within the dtype's noise (a tie,
split differently by 1 + K rows than by 1: the same rule as the GPU test).
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.conftest import DEVICE  # sets TRITON_INTERPRET=1 on CPU, before the kernels are imported

pytest.importorskip("triton", reason="pip install -c constraints.txt 'peagle-trt[dev]' (triton==3.9.0)")

from peagle_trt.checkpoint import load_pair  # noqa: E402
from peagle_trt.config import SpecConfig  # noqa: E402
from peagle_trt.executors.torch import TorchExecutor  # noqa: E402
from peagle_trt.runtime.scheduler import generate  # noqa: E402
from peagle_trt.speculative.decoder import SpecDecoder  # noqa: E402
from tests.helpers import ScriptedDrafter, greedy  # noqa: E402

pytestmark = [pytest.mark.kernels, pytest.mark.skipif(DEVICE != "cpu", reason="the GPU runs tests/plugins")]
PROMPTS = ([5, 17, 99, 3, 42, 7, 250, 8, 11], [300, 1])
TOKENS = 8


@pytest.fixture(autouse=True)
def on_cpu():
    from peagle_trt.ops import kernels

    with kernels.rehearsal():
        yield


def _decoder(tiny, mode: str, k: int, kernels: str, proposer=None) -> SpecDecoder:
    spec = SpecConfig(mode, k)
    t, d = load_pair(tiny["llama"], tiny["aws"] if mode != "none" else None, spec).build("cpu", torch.float32)
    ex = TorchExecutor(t, d, 1, 128, kernels=kernels, fuse=kernels == "cuda")  # as on a GPU: fused projections
    return SpecDecoder(ex, spec, proposer=proposer)


def _gap(dec: SpecDecoder, prompt: list[int], a: list[int], b: list[int]) -> float:
    """Where outputs a and b part: how far below the target's top logit each one's token is, the larger."""
    i = next(j for j in range(len(a)) if a[j] != b[j])
    seq = prompt + a[:i]
    logits, _ = dec.ex.target(torch.tensor([seq]), torch.arange(len(seq))[None], torch.tensor([[0]]))
    row = logits[0, -1]
    return max(float(row.max() - row[a[i]]), float(row.max() - row[b[i]])) / max(float(row.abs().max()), 1.0)


def test_kernel_executor_logits_match_the_reference_ops(tiny):
    ids = torch.tensor([PROMPTS[0]])
    pos = torch.arange(ids.shape[1])[None]
    got, aux = _decoder(tiny, "none", 1, "cuda").ex.target(ids, pos, torch.tensor([[0]]))
    want, aux_want = _decoder(tiny, "none", 1, "reference").ex.target(ids, pos, torch.tensor([[0]]))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(aux, aux_want, atol=1e-4, rtol=1e-4)


def test_kernel_executor_with_fp8_caches_matches_the_reference_ops(tiny):
    """--kv-cache-dtype fp8 on the kernels: the cache's scales reach the Triton kernel, which stores the
    reference's codes and reads them back as it does (a prefill, then a decode row over them). Codes are
    compared as values: the interpreter's rounding (`_round_to_e4m3`) stores -0 as +0."""
    from peagle_trt.config import KVLayout

    t, _ = load_pair(tiny["llama"], None, SpecConfig("none", 1)).build("cpu", torch.float32)
    exs = [TorchExecutor(t, None, KVLayout.for_sequences(1, 64, cache_dtype="fp8"), kernels=k)
           for k in ("cuda", "reference")]
    for ex in exs:  # not 1.0: a scale that did not reach the kernel would show
        cache = ex.target_cache
        cache.k_scale[:], cache.v_scale[:] = [0.25] * len(cache.k_scale), [0.5] * len(cache.v_scale)
    prefill = (torch.tensor([PROMPTS[0][:4]]), torch.arange(4)[None])
    for rows, pos in (prefill, (torch.tensor([[9]]), torch.tensor([[4]]))):  # then a decode row
        got, want = (ex.target(rows, pos, torch.tensor([[0]]))[0] for ex in exs)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    caches = [ex.target_cache.k + ex.target_cache.v for ex in exs]
    assert all(c.dtype == torch.float8_e4m3fn for c in caches[0])
    assert all(torch.equal(got.float(), want.float()) for got, want in zip(*caches))


@pytest.fixture
def launches(monkeypatch):
    """Counts the kernel launchers' calls, and splits every attention over the context (segments of
    16 keys: the tiny model's contexts are far below the GPU's MIN_CHUNK)."""
    from peagle_trt.ops.triton_kernels import draft_inputs, draft_sample, kv_attention, norm_rope

    counts = {}

    def counting(name, fn):
        def counted(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)
        return counted

    for module, name in ((kv_attention, "kv_attention"), (norm_rope, "rms_norm"), (norm_rope, "rope"),
                         (draft_inputs, "draft_inputs"), (draft_sample, "draft_sample")):
        monkeypatch.setattr(module, name, counting(name, getattr(module, name)))
    monkeypatch.setattr(kv_attention, "MIN_CHUNK", 16)
    splits = []
    plan = kv_attention.split_plan
    monkeypatch.setattr(kv_attention, "split_plan", lambda *a: splits.append(plan(*a)) or splits[-1])
    counts["splits"] = splits
    return counts


def test_oracle_and_real_drafts_are_exact_on_the_kernels(tiny, launches):
    plain = _decoder(tiny, "none", 1, "cuda")
    refs = {tuple(p): generate(plain, list(p), greedy(TOKENS)).output for p in PROMPTS}
    oracle = _decoder(tiny, "peagle", 3, "cuda", proposer=ScriptedDrafter(refs, 512, lambda i, rng: True))
    real = _decoder(tiny, "peagle", 3, "cuda")
    for prompt, expected in refs.items():
        seq = generate(oracle, list(prompt), greedy(TOKENS))
        assert seq.output == expected and seq.stats.accepted >= TOKENS // 2
        got = generate(real, list(prompt), greedy(TOKENS)).output
        assert got == expected or _gap(plain, list(prompt), got, expected) <= 1e-5, (prompt, got, expected)
    assert {"kv_attention", "rms_norm", "rope", "draft_inputs", "draft_sample"} <= set(launches)
    assert max(launches["splits"]) > 1  # the split-KV kernels and their reduce ran


def test_moe_target_on_the_kernels_reads_once_per_step(tiny_moe, monkeypatch):
    """A MoE target (tiny Qwen3-MoE) on the kernels: the fused MoE kernel serves its sparse layers
    (peagle_trt/ops/triton_kernels/moe.py), its logits match the reference ops', and a P-EAGLE step
    reads the device once: the MoE path reads nothing back (what lets a GPU capture it in a graph)."""
    import collections

    from peagle_trt.config import SamplingParams
    from peagle_trt.ops.triton_kernels import moe as moe_kernels
    from tests.speculative.test_host_reads import counting_reads

    calls = collections.Counter()
    original = moe_kernels.moe
    monkeypatch.setattr(moe_kernels, "moe", lambda *a, **k: calls.update(["moe"]) or original(*a, **k))
    spec = SpecConfig("peagle", 2)
    decoders = {}
    for kernels in ("cuda", "reference"):
        t, d = load_pair(tiny_moe["qwen3_moe"], tiny_moe["drafter-qwen3_moe"], spec).build("cpu", torch.float32)
        decoders[kernels] = SpecDecoder(TorchExecutor(t, d, 1, 64, kernels=kernels, cuda_graphs=False), spec)
    ids = torch.tensor([PROMPTS[0]])
    pos = torch.arange(ids.shape[1])[None]
    got, _ = decoders["cuda"].ex.target(ids, pos, torch.tensor([[0]]))
    want, _ = decoders["reference"].ex.target(ids, pos, torch.tensor([[0]]))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert calls["moe"] == 6  # the six sparse layers (layers 0 and 5 are dense)
    dec = decoders["cuda"]
    seq = dec.new_sequence(PROMPTS[1], SamplingParams(max_tokens=8, ignore_eos=True))
    seq.blocks = [list(range(dec.ex.kv.max_blocks))]
    dec.batch = 1
    dec.prefill([seq])
    dec.step([seq])
    reads = collections.Counter()
    with counting_reads(reads):
        dec.step([seq])
    assert sum(reads.values()) == 1, dict(reads)
