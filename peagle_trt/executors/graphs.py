"""CUDA graphs for the torch executor: each forward shape captured once per batch bucket, then replayed.

Eager forwards of a decoder launch hundreds of small kernels one by one, and on a GPU the step's time
follows the host (docs/BENCHMARKS.md "gpu": MBU 0.07-0.18). A graph replays them in one launch.

    buckets       batch sizes 1, 2, 4, then steps of 8 (vLLM's), up to the executor's batch
    bucket(b)     the smallest bucket >= b; None past the largest: that forward runs eagerly
    limits        rows per request <= MAX_ROWS (a verify of 1 + K or of a tree; a prefill's drafting
                  pass over a long prompt chunk stays eager) and at most MAX_GRAPHS shapes (the
                  first ones met: a server's decode shapes come with its first steps)
    pad           each input padded along its batch axis to the bucket with rows that change nothing:
                  tokens 0, positions -1 (padding rows write to the trash block), block tables -1,
                  a drafter's pending count 1 over cur 1 (one padding row at position 0, in no block)
    GraphRunner   per key (what, bucket, shapes past the batch) one graph over static input buffers
                  (block tables included): captured on first use after a warm-up on a side stream,
                  replayed after the inputs are copied in; outputs are sliced back to the batch.
                  A forward that cannot be captured (a host sync inside: the reference ops' MoE
                  routing, kernels="reference" on a GPU; the deterministic ops) runs eagerly from
                  then on, once warned. On the kernels (kernels="cuda") a MoE target is captured like
                  a dense one: its fused MoE reads nothing back (peagle_trt/ops/triton_kernels/moe.py).
Attention spans are static inside a graph: the whole block table (ops.reference.key_span), so a
replay serves any context length. The same forward run eagerly at the same bucket and span gives the
same bits (tests/executors/test_cuda_graphs.py, GPU-marked; its bucket and padding tests run on CPU).
Used by TorchExecutor(cuda_graphs=True), the default on CUDA; `--no-cuda-graphs` turns it off.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from peagle_trt.ops.reference import key_span

MAX_ROWS = 65  # rows per request a captured forward may have: 1 + the most draft rows (64 tree nodes)
MAX_GRAPHS = 64  # captured shapes per executor


def buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, ... (steps of 8) up to the first bucket >= max_batch."""
    out = [1, 2, 4, 8]
    while out[-1] < max_batch:
        out.append(out[-1] + 8)
    return tuple(b for b in out if b < max_batch) + (next(b for b in out if b >= max_batch),)


def bucket(b: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest of `sizes` holding b rows, None when none does (eager)."""
    return next((s for s in sizes if s >= b), None)


@dataclass(frozen=True)
class Input:
    """One forward input: its tensor, the axis its batch runs along, the value padding rows take."""
    tensor: torch.Tensor
    axis: int
    pad: float | int


def pad(x: Input, size: int) -> torch.Tensor:
    """x.tensor padded with x.pad along x.axis to `size` rows."""
    t = x.tensor
    extra = size - t.shape[x.axis]
    if extra <= 0:
        return t
    shape = list(t.shape)
    shape[x.axis] = extra
    return torch.cat([t, t.new_full(shape, x.pad)], dim=x.axis)


class GraphRunner:
    """Captured forwards of one executor, keyed by (what, bucket, shapes past the batch)."""

    def __init__(self, max_batch: int, span: int, device: torch.device):
        self.sizes = buckets(max_batch)
        self.span = span  # keys every captured attention reads: the whole block table
        self.device = device
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], tuple[torch.Tensor, ...]]] = {}
        self.eager: set[tuple] = set()  # keys that could not be captured
        self.pool = None  # one memory pool for every graph (they never run at once)
        self.replays = 0

    def run(self, what: str, fn: Callable[..., tuple[torch.Tensor, ...]], inputs: list[Input], b: int
            ) -> tuple[torch.Tensor, ...] | None:
        """fn(*inputs) replayed at b's bucket -> outputs (batch first) sliced to b rows; None where
        the caller must run eagerly (no bucket, or the forward cannot be captured). Outputs are the
        graph's own buffers until its next replay: callers clone what they keep."""
        size = bucket(b, self.sizes)
        if size is None or inputs[0].tensor.shape[1] > MAX_ROWS:
            return None
        key = (what, size) + tuple(tuple(x.tensor.shape[:x.axis]) + tuple(x.tensor.shape[x.axis + 1:])
                                   + (x.tensor.dtype,) for x in inputs)
        if key in self.eager:
            return None
        entry = self.graphs.get(key)
        if entry is None:
            if len(self.graphs) >= MAX_GRAPHS:
                return None
            entry = self._capture(key, fn, [pad(x, size) for x in inputs])
            if entry is None:
                return None
        graph, static, outputs = entry
        for buf, x in zip(static, inputs):
            buf.copy_(pad(x, size))
        graph.replay()
        self.replays += 1
        return tuple(o[:b] for o in outputs)

    def _capture(self, key, fn, padded: list[torch.Tensor]):
        static = [t.clone() for t in padded]
        try:
            graph, outputs = self._record(fn, static)
        except Exception as exc:  # noqa: BLE001 -- any capture failure: this shape runs eagerly
            self.eager.add(key)
            warnings.warn(f"CUDA graph capture of {key[0]} at batch {key[1]} failed ({type(exc).__name__}: "
                          f"{exc}); it runs eagerly", RuntimeWarning, stacklevel=3)
            return None
        entry = (graph, static, tuple(outputs))
        self.graphs[key] = entry
        return entry

    def _record(self, fn, static: list[torch.Tensor]):
        """(graph, its output buffers): fn(*static) warmed up on a side stream, then captured."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), key_span(self.span):
            for _ in range(2):  # warm-up: lazy inits, autotuning, the allocator's first blocks
                fn(*static)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), key_span(self.span):
            outputs = fn(*static)
        self.pool = graph.pool()
        return graph, outputs
