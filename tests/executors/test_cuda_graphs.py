"""CUDA graphs of the torch executor (peagle_trt/executors/graphs.py).

On CPU: the batch buckets (1, 2, 4, then steps of 8) and the padding of each input along its batch
axis; the executor refuses graphs off CUDA and keeps them off by default there; and a rehearsal of
the runner's whole path (keys, static buffers, padding, slicing, the executor's replayed target and
drafter passes) with a stand-in recorder that re-runs the captured function at each replay.
On a GPU (marked gpu: scripts/gpu_validate.sh): a replayed decode, verify (1 + K rows, a tree) and
P-EAGLE drafter pass give the bits the same forward gives eagerly at the same bucket and attention
span, and speculative greedy output with graphs equals target-only output with graphs.
"""

from __future__ import annotations

import pytest
import torch

from peagle_trt.checkpoint import load_pair
from peagle_trt.config import SpecConfig
from peagle_trt.errors import ConfigError
from peagle_trt.executors.graphs import GraphRunner, Input, bucket, buckets, pad
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.ops.reference import key_span
from peagle_trt.runtime.scheduler import Request, Scheduler, generate
from peagle_trt.speculative.decoder import SpecDecoder
from tests.helpers import collect, greedy

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_buckets_are_1_2_4_then_steps_of_8():
    assert buckets(1) == (1,) and buckets(3) == (1, 2, 4) and buckets(8) == (1, 2, 4, 8)
    assert buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64) and buckets(10) == (1, 2, 4, 8, 16)
    sizes = buckets(64)
    assert [bucket(b, sizes) for b in (1, 2, 3, 5, 8, 9, 17, 64)] == [1, 2, 4, 8, 8, 16, 24, 64]
    assert bucket(65, sizes) is None  # past the largest bucket: eager


def test_padding_rows_change_nothing():
    tokens, tables = torch.tensor([[5, 6]]), torch.tensor([[[3, 4]], [[7, 8]]])  # [1, 2], [G=2, 1, M=2]
    assert pad(Input(tokens, 0, 0), 4).tolist() == [[5, 6], [0, 0], [0, 0], [0, 0]]
    assert pad(Input(torch.tensor([[9, 10]]), 0, -1), 2).tolist() == [[9, 10], [-1, -1]]  # positions: no slot
    padded = pad(Input(tables, 1, -1), 2)  # block tables: their batch is axis 1
    assert padded.shape == (2, 2, 2) and padded[:, 1].eq(-1).all() and padded[:, :1].equal(tables)
    assert pad(Input(tokens, 0, 0), 1) is tokens


def test_graphs_need_cuda_and_are_off_on_cpu(tiny):
    pair = load_pair(tiny["llama"], tiny["aws"], SpecConfig("peagle", 3))
    t, d = pair.build()
    assert TorchExecutor(t, d, 1, 64).graphs is None
    with pytest.raises(ConfigError, match="cuda_graphs"):
        TorchExecutor(t, d, 1, 64, cuda_graphs=True)


class ReplayOnCPU:
    """A stand-in for a CUDA graph: replay re-runs the captured function over the static inputs,
    at the captured attention span, into the captured output buffers."""

    def __init__(self, fn, static, span):
        self.fn, self.static, self.span = fn, static, span
        with key_span(span):
            self.outputs = fn(*static)

    def replay(self):
        with key_span(self.span):
            for out, new in zip(self.outputs, self.fn(*self.static)):
                out.copy_(new)


class CPURunner(GraphRunner):
    def _record(self, fn, static):
        graph = ReplayOnCPU(fn, static, self.span)
        return graph, graph.outputs


@pytest.mark.parametrize("mode, drafter, k", [("peagle", "aws", 3), ("eagle3", "eagle3", 2)])
def test_the_runner_path_rehearsed_on_cpu(tiny, mode, drafter, k):
    """Greedy speculation through the runner (batches 1 and 3: buckets 1 and 4, padded) equals
    target-only output; the verify and P-EAGLE drafting shapes were replayed."""
    spec = SpecConfig(mode, k)
    t, d = load_pair(tiny["llama"], tiny[drafter], spec).build()
    plain = SpecDecoder(TorchExecutor(t, None, 3, 128), SpecConfig("none", 0))
    ex = TorchExecutor(t, d, 3, 128)
    ex.graphs = CPURunner(3, ex.kv.max_blocks * ex.kv.block_size, ex.device)
    fast = SpecDecoder(ex, spec)
    for prompts in ([[1, 2, 3]], [[4, 5], list(range(7, 30)), [9]]):
        ref = [generate(plain, p, greedy(12)).output for p in prompts]
        sched = Scheduler(fast, max_batch=3)
        outputs = {}
        for i, p in enumerate(prompts):
            sched.add(Request(str(i), p, greedy(12), on_output=collect(outputs)))
        sched.run_until_idle()
        assert [outputs[str(i)]["ids"] for i in range(len(prompts))] == ref
    kinds = {key[:2] for key in ex.graphs.graphs}
    assert ("target", 1) in kinds and ("target", 4) in kinds and ex.graphs.replays > 0
    assert (mode != "peagle") or any(key[0].startswith("draft") for key in ex.graphs.graphs)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("batch", [1, 3])
def test_replay_equals_eager_at_the_same_bucket(tiny, batch):
    spec = SpecConfig("peagle", 3)
    t, d = load_pair(tiny["llama"], tiny["aws"], spec).build("cuda", torch.bfloat16)
    ex = TorchExecutor(t, d, 4, 256)
    assert ex.graphs is not None
    size, span, dev = ex.graphs.sizes[0 if batch == 1 else 2], ex.kv.max_blocks * ex.kv.block_size, ex.device
    tables = torch.arange(size, device=dev)  # sequence i: the static layout's blocks
    gen = torch.Generator().manual_seed(batch)
    for rows in (1, 4):  # decode, verify of 1 + 3
        tokens = torch.randint(0, 500, (batch, rows), generator=gen).to(dev)
        positions = (torch.arange(rows) + 20)[None].expand(batch, -1).to(dev)
        logits, aux = ex.target(tokens, positions, tables[:batch])  # replayed (captured on first use)
        logits, aux = logits.clone(), aux.clone()
        graphs, ex.graphs = ex.graphs, None
        with key_span(span):  # eager at the bucket and span the graph has
            eager, eager_aux = ex.target(torch.cat([tokens, tokens.new_zeros(size - batch, rows)]),
                                         torch.cat([positions, positions.new_full((size - batch, rows), -1)]),
                                         tables)
        ex.graphs = graphs
        assert torch.equal(logits, eager[:batch]) and torch.equal(aux, eager_aux[:batch]), rows
    assert ex.graphs.replays >= 2 and not ex.graphs.eager


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("mode, k", [("peagle", 3), ("eagle3", 3), ("peagle", 7)])
def test_greedy_speculation_with_graphs_equals_target_only_with_graphs(tiny, mode, k):
    spec = SpecConfig(mode, k)
    drafter = tiny["aws" if mode == "peagle" else "eagle3"]
    t, d = load_pair(tiny["llama"], drafter, spec).build("cuda", torch.float32)
    plain = SpecDecoder(TorchExecutor(t, None, 1, 256), SpecConfig("none", 0))
    fast = SpecDecoder(TorchExecutor(t, d, 1, 256), spec)
    for prompt in ([1, 2, 3], list(range(5, 45))):
        assert generate(fast, prompt, greedy(24)).output == generate(plain, prompt, greedy(24)).output
    assert fast.ex.graphs.replays > 0 and not fast.ex.graphs.eager


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_moe_targets_are_captured_and_speculate_exactly(tiny_moe, family):
    """MoE targets on the fused MoE kernel (peagle_trt/ops/triton_kernels/moe.py): no host sync in a MoE
    layer, so their decode and verify forwards are captured like a dense target's (none run eagerly),
    and greedy speculation with graphs equals target-only decoding with graphs."""
    spec = SpecConfig("peagle", 3)
    t, d = load_pair(tiny_moe[family], tiny_moe[f"drafter-{family}"], spec).build("cuda", torch.float32)
    plain = SpecDecoder(TorchExecutor(t, None, 1, 256, kernels="cuda"), SpecConfig("none", 0))
    fast = SpecDecoder(TorchExecutor(t, d, 1, 256, kernels="cuda"), spec)
    for prompt in ([1, 2, 3], list(range(5, 45))):
        assert generate(fast, prompt, greedy(24)).output == generate(plain, prompt, greedy(24)).output
    for ex in (plain.ex, fast.ex):
        assert ex.graphs.replays > 0 and not ex.graphs.eager, ex.graphs.eager
