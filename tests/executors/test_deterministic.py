"""Deterministic mode as a property: a request's greedy output (and its logits, bit for bit) do
not depend on what shares its forwards. For the toy pair in float32 and FP8, on the torch and
onnxruntime executors: alone without speculation == alone with P-EAGLE at K in {1, 3, 7} ==
EAGLE-3 == in a batch of 8 mixed requests, prefix reuse on and off, and while a busy process
loads the cores (peagle_trt/ops/deterministic.py; docs/SERVING.md, "Deterministic mode")."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from peagle_trt.checkpoint import load_pair
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError
from peagle_trt.executors.onnxruntime import OrtExecutor
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.ops import deterministic as det
from peagle_trt.runtime.scheduler import Request, Scheduler, generate
from peagle_trt.speculative.decoder import SpecDecoder
from tests.helpers import collect

PROMPT = [3, 4, 5]
MODES = [("none", 1), ("peagle", 1), ("peagle", 3), ("peagle", 7), ("eagle3", 3)]


def mixed_batch(seed: int = 5) -> list[tuple[list[int], SamplingParams]]:
    """8 requests: PROMPT (greedy, 24 tokens) first, 6 others of other lengths (greedy or sampled),
    and PROMPT again with another length (prefix reuse shares its first block when it is on)."""
    rng = random.Random(seed)
    out = [(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))]
    for i in range(6):
        prompt = [rng.randrange(1, 500) for _ in range(rng.randint(1, 60))]
        out.append((prompt, SamplingParams(max_tokens=rng.randint(5, 40), temperature=0.8 * (i % 2), seed=i,
                                           ignore_eos=True)))
    return out + [(PROMPT, SamplingParams(max_tokens=9, ignore_eos=True))]


def run_batch(decoder: SpecDecoder, requests, prefix_caching: bool) -> list[int]:
    """All requests queued at once through one scheduler; returns the first request's ids."""
    sched = Scheduler(decoder, prefill_chunk=16, prefix_caching=prefix_caching)
    outputs: dict = {}
    for i, (prompt, params) in enumerate(requests):
        sched.add(Request(str(i), prompt, params, collect(outputs)))
    sched.run_until_idle()
    assert all(outputs[str(i)]["final"] == 1 for i in range(len(requests)))
    return outputs["0"]["ids"]


def pair(tiny, target_dir, mode: str, k: int):
    spec = SpecConfig(mode, k)
    drafter = {"none": None, "peagle": tiny["aws"], "eagle3": tiny["eagle3"]}[mode]
    return (*load_pair(target_dir, drafter, spec).build(), spec)


@pytest.fixture(scope="module")
def fp8_llama(tiny, tmp_path_factory):
    pytest.importorskip("modelopt")
    from peagle_trt.quantize import QuantizeOptions, quantize_target

    out = tmp_path_factory.mktemp("det-fp8") / "llama-fp8"
    quantize_target(tiny["llama"], out, QuantizeOptions(num_calib=4))
    return out


# -- the building blocks ---------------------------------------------------------------------------
def test_linear_rows_gives_every_row_the_same_bits_alone_and_anywhere_in_a_batch():
    weight, bias = torch.randn(576, 192), torch.randn(576)
    x = torch.randn(21, 192)
    alone = [det.linear_rows(x[i:i + 1], weight, bias) for i in range(len(x))]
    for n in (2, 3, 8, 9, 21):
        got = det.linear_rows(x[:n], weight, bias)
        for i in range(n):
            assert torch.equal(got[i:i + 1], alone[i]), (n, i)
    shuffled = torch.randperm(21)
    assert torch.equal(det.linear_rows(x[shuffled], weight, bias), torch.cat(alone)[shuffled])
    assert torch.allclose(torch.cat(alone), F.linear(x, weight, bias), atol=1e-4)


def test_rows_routes_linear_fixes_threads_and_restores_them():
    before = torch.get_num_threads()
    with det.rows():
        assert det.active() and torch.get_num_threads() == det.THREADS
        lin = torch.nn.Linear(8, 4)
        assert torch.equal(lin(torch.ones(3, 8)), det.linear_rows(torch.ones(3, 8), lin.weight, lin.bias))
    assert not det.active() and torch.get_num_threads() == before


def test_deterministic_refuses_the_triton_kernels(tiny):
    target, drafter, _ = pair(tiny, tiny["llama"], "peagle", 3)
    with pytest.raises(ConfigError, match="kernels='reference'"):
        TorchExecutor(target, drafter, 1, 64, kernels="cuda", deterministic=True)


# -- one forward: a row's logits, bit for bit --------------------------------------------------------
def _first_row_logits(ex, batch: int, rows: int) -> torch.Tensor:
    """Request 0 ([1..5] prefilled, then `rows` rows at positions 5..) in a forward with `batch`
    requests of other contents and lengths; returns request 0's logits [rows, V]."""
    kv = ex.kv
    m = kv.max_blocks
    tables = torch.full((1, batch, m), -1, dtype=torch.int64)
    for b in range(batch):
        tables[0, b, :2] = torch.tensor([2 * b, 2 * b + 1])
    prefill = torch.tensor([[1, 2, 3, 4, 5]] + [[7 + b] * 5 for b in range(1, batch)])
    ex.target(prefill, torch.arange(5).expand(batch, -1).contiguous(), tables)
    width = rows + (batch > 1) * 3  # the others verify more rows than request 0
    tokens = torch.randint(1, 400, (batch, width))
    tokens[0, :rows] = torch.tensor([9, 8, 7, 6, 5, 4, 3, 2][:rows])
    positions = (5 + torch.arange(width)).expand(batch, -1).clone()
    positions[0, rows:] = -1  # request 0's padding rows
    logits, _ = ex.target(tokens, positions, tables)
    return logits[0, :rows]


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_a_rows_logits_do_not_depend_on_batch_or_rows(tiny, fp8_llama, backend, fp8):
    target, _, _ = pair(tiny, fp8_llama if fp8 else tiny["llama"], "none", 1)

    def make():
        if backend == "torch":
            return TorchExecutor(target, None, 4, 96, deterministic=True)
        return OrtExecutor.from_models(target, None, None, 4, 96, deterministic=True)

    alone = _first_row_logits(make(), 1, 1)
    for batch, rows in ((1, 4), (3, 1), (4, 4), (4, 8)):
        got = _first_row_logits(make(), batch, rows)
        assert torch.equal(got[:1], alone), (batch, rows)


# -- whole requests ------------------------------------------------------------------------------
def _outputs(tiny, target_dir, backend: str) -> dict:
    """{(mode, k, case): request 0's ids}; cases: alone, in the batch with prefix reuse, and (P-EAGLE
    K=3 on torch) in the batch without prefix reuse."""
    outs = {}
    for mode, k in MODES:
        target, drafter, spec = pair(tiny, target_dir, mode, k)
        no_reuse = backend == "torch" and (mode, k) == ("peagle", 3)
        for case in ("alone", "batch+prefix", "batch") if no_reuse else ("alone", "batch+prefix"):
            if backend == "torch":
                ex = TorchExecutor(target, drafter, 8, 128, deterministic=True)
            else:
                ex = OrtExecutor.from_models(target, drafter, spec, 8, 128, deterministic=True)
            decoder = SpecDecoder(ex, spec)
            if case == "alone":
                outs[mode, k, case] = generate(decoder, PROMPT, SamplingParams(max_tokens=24, ignore_eos=True)).output
            else:
                outs[mode, k, case] = run_batch(decoder, mixed_batch(), prefix_caching=case == "batch+prefix")
    return outs


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_output_is_the_same_alone_batched_and_with_any_speculation(tiny, fp8_llama, backend, fp8):
    outs = _outputs(tiny, fp8_llama if fp8 else tiny["llama"], backend)
    reference = outs["none", 1, "alone"]
    assert len(reference) == 24 and len(outs) == 2 * len(MODES) + (backend == "torch")
    assert {key: out for key, out in outs.items() if out != reference} == {}


def test_output_is_the_same_under_cpu_load(tiny, fp8_llama):
    """A busy process on every core while the FP8 pair decodes: same tokens as idle."""
    target, drafter, spec = pair(tiny, fp8_llama, "peagle", 3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    idle = generate(SpecDecoder(TorchExecutor(target, drafter, 1, 64, deterministic=True), spec), PROMPT, params)
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(2)]
    try:
        loaded = generate(SpecDecoder(TorchExecutor(target, drafter, 8, 128, deterministic=True), spec),
                          PROMPT, params)
        plain = generate(SpecDecoder(TorchExecutor(target, None, 8, 128, deterministic=True),
                                     SpecConfig("none", 3)), PROMPT, params)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert loaded.output == idle.output == plain.output and loaded.stats.drafter_forwards > 0


_THREADS_SCRIPT = """
import sys, torch
from peagle_trt.checkpoint import load_pair
from peagle_trt.config import SpecConfig
from peagle_trt.executors.onnxruntime import OrtExecutor
from tests.executors.test_deterministic import _first_row_logits
torch.manual_seed(0)
target, _ = load_pair(sys.argv[1], None, SpecConfig("none", 1)).build()
ex = OrtExecutor.from_models(target, None, None, 4, 96, threads=int(sys.argv[2]), deterministic=True)
torch.save(_first_row_logits(ex, 4, 4), sys.argv[3])
"""


def test_onnxruntime_thread_count_changes_no_bit(tiny, tmp_path):
    """The process-wide pool's size (1 vs 2 threads, each in its own process) gives the same logits."""
    for threads in (1, 2):
        subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, str(tiny["llama"]), str(threads),
                        str(tmp_path / f"{threads}.pt")], check=True, cwd=Path(__file__).parents[2])
    assert torch.equal(torch.load(tmp_path / "1.pt"), torch.load(tmp_path / "2.pt"))
