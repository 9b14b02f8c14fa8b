"""The torch executor: the reference models (peagle_trt/models/) behind the `Executor` interface of
peagle_trt/speculative/executor.py, on CPU or CUDA.

KV caches live in the executor, paged (models/kv_cache.py, laid out by a `KVLayout`); which blocks
a request holds is the runtime's business (runtime/blocks.py): every forward gets block tables.
The kernels option: `TorchExecutor(kernels="cuda")` runs the custom ops (the MoE layers' included) on the
Triton kernels (peagle_trt/ops/triton_kernels, JIT-compiled on the GPU through peagle_trt.ops.kernels.routed())
instead of their torch references; the TensorRT plugins launch the same kernels compiled ahead of time.
The deterministic option: `TorchExecutor(deterministic=True)` runs every forward inside
peagle_trt.ops.deterministic.rows() (GEMMs on fixed row blocks, attention row by row, fixed
threads): a request's output no longer depends on its batch, its draft count or the thread count.
The CUDA graphs option: `TorchExecutor(cuda_graphs=None)` (on where the models are on CUDA and the
forwards are not deterministic; False: off, `--no-cuda-graphs`) replays decode and verify forwards
(no logit rows: every row's logits) and the P-EAGLE drafter pass as CUDA graphs per batch bucket
(peagle_trt/executors/graphs.py); prefill, other shapes and batches past the buckets run eagerly.
"""

from __future__ import annotations

import contextlib

import torch

from peagle_trt.config import KERNELS, KVLayout
from peagle_trt.errors import ConfigError
from peagle_trt.models.layers import fuse_projections
from peagle_trt.ops import deterministic as det
from peagle_trt.ops.reference import draft_inputs, draft_sample


def check_kernels(kernels: str) -> str:
    if kernels not in KERNELS:
        raise ConfigError(f"kernels={kernels!r} is not one of {KERNELS}: 'reference' runs the custom ops "
                          "in torch (any device), 'cuda' on the Triton kernels (GPU, triton installed)")
    return kernels


class TorchExecutor:
    """Reference executor over `TargetModel` / `DrafterModel` (CPU or CUDA) with caches laid out
    by `kv` (a KVLayout, or N: room for N requests of `max_len` positions). kernels="cuda": the
    custom ops (KV attention, draft-input assembly, draft sampling) run on the Triton kernels; raises
    KernelsUnavailable (a ConfigError) without a CUDA device or triton. deterministic=True: every
    forward is row- and batch-invariant (peagle_trt/ops/deterministic.py); reference ops only.
    fuse (default: on CUDA outside deterministic mode): the models' q/k/v and gate/up projections
    become one matmul each, in place (models/layers.py `fuse_projections`)."""

    def __init__(self, target, drafter=None, kv: KVLayout | int = 1, max_len: int = 2048, kernels: str = "reference",
                 deterministic: bool = False, cuda_graphs: bool | None = None, fuse: bool | None = None):
        self.target_model, self.drafter_model = target, drafter
        self.kv = kv if isinstance(kv, KVLayout) else KVLayout.for_sequences(kv, max_len)
        self.device = target.lm_head.weight.device
        if fuse is None:
            fuse = self.device.type == "cuda" and not deterministic
        for model in (target, drafter) if fuse else ():  # q/k/v and gate/up: one matmul each
            if model is not None:
                fuse_projections(model)
        self.kernels = check_kernels(kernels)
        self.deterministic = deterministic
        self._ops = det.rows if deterministic else contextlib.nullcontext
        if kernels == "cuda" and deterministic:
            raise ConfigError("deterministic=True runs the custom ops' torch references row by row; the Triton "
                              "kernels (kernels='cuda') are not routed through it: use kernels='reference'")
        if kernels == "cuda":
            from peagle_trt.ops import kernels as cuda_kernels

            cuda_kernels.require(self.device)
            self._ops = cuda_kernels.routed
        self.target_cache = target.new_cache(self.kv)
        self.drafter_cache = drafter.new_cache(self.kv) if drafter is not None else None
        self.windows = target.kv_windows
        self.mask_token_id = drafter.config.mask_token_id if drafter is not None else None
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and not deterministic
        if cuda_graphs and (self.device.type != "cuda" or deterministic):
            raise ConfigError("cuda_graphs=True replays forwards captured on a CUDA device, without host syncs: it "
                              f"needs the models on CUDA (here {self.device}) and deterministic=False "
                              "(--no-cuda-graphs turns it off)")
        self.graphs = None
        if cuda_graphs:
            from peagle_trt.executors.graphs import GraphRunner

            self.graphs = GraphRunner(self.kv.max_batch, self.kv.max_blocks * self.kv.block_size, self.device)

    # -- forwards ------------------------------------------------------------------------------
    @torch.inference_mode()
    def target(self, tokens, positions, tables, logit_rows=None, tree_mask=None):
        # tokens, positions [B, S]; tables [G, B, M] block tables; logit_rows [B, R] | None;
        # tree_mask [B, S, W] int32 | None (draft-tree rows: ops.reference.kv_attention)
        # -> logits [B, R or S, V] float32, aux [B, S, 3 * H_t]
        if self.graphs is not None and logit_rows is None:  # decode and verify: replayed per batch bucket
            out = self._replayed("target", self._target, tokens, positions, tables, tree_mask)
            if out is not None:
                return out[0], out[1].clone()  # logits: read within the step; aux: kept by requests
        with self._ops():
            return self.target_model(tokens, positions, tables, self.target_cache, logit_rows, tree_mask)

    def _target(self, tokens, positions, tables, tree_mask=None):
        with self._ops():
            return self.target_model(tokens, positions, tables, self.target_cache, None, tree_mask)

    def _replayed(self, what, fn, tokens, positions, tables, tree_mask=None, extra=()):
        """fn's outputs replayed as a CUDA graph at the batch's bucket (graphs.py); None: run eagerly."""
        from peagle_trt.executors.graphs import Input

        inputs = [Input(tokens, 0, 0), Input(positions, 0, -1), Input(self.kv_tables(tables), 1, -1)]
        inputs += [Input(tree_mask, 0, 0)] if tree_mask is not None else []
        return self.graphs.run(what, fn, inputs + list(extra), tokens.shape[0])

    def kv_tables(self, tables: torch.Tensor) -> torch.Tensor:
        """Block tables [G, B, M] (sequence indices [B] of a static cache turned into theirs)."""
        return self.target_cache.tables(tables)

    @torch.inference_mode()
    def move_kv(self, tables, src, dst):
        # tables [G, B, M]; src, dst [B, R] target KV positions: rows at src are copied to dst (-1: none)
        self.target_cache.move(tables, src, dst)

    @torch.inference_mode()
    def drafter(self, tokens, hidden, positions, tables):
        # tokens, positions [B, S]; hidden [B, S, H] -> draft logits [B, S, V_d], pre-norm [B, S, H]
        with self._ops():
            return self.drafter_model(tokens, hidden, positions, tables, self.drafter_cache)

    @torch.inference_mode()
    def project(self, aux: torch.Tensor) -> torch.Tensor:
        with self._ops():
            return self.drafter_model.project(aux)  # [..., 3 * H_t] -> [..., H]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.drafter_model.to_target_ids(draft_ids)

    @torch.inference_mode()
    def draft_parallel(self, tokens, aux, num_pending, cur, tables, k: int) -> torch.Tensor:
        # tokens [B, P] pending ids (padded), aux [B, P, 3 * H_t] their target taps, num_pending [B],
        # cur [B] (pending rows sit at cur-n .. cur-1), tables [G, B, M] -> draft ids [B, K]: ONE forward
        if self.graphs is not None:  # the P-EAGLE pass: replayed per batch bucket
            from peagle_trt.executors.graphs import Input

            def draft(tokens, cur, tables, aux, num_pending):
                return (self._draft_eager(tokens, aux, num_pending, cur, tables, k),)

            out = self.graphs.run(f"draft{k}", draft, [Input(tokens, 0, 0), Input(cur, 0, 1),
                                                      Input(self.kv_tables(tables)[:1], 1, -1), Input(aux, 0, 0),
                                                      Input(num_pending, 0, 1)], tokens.shape[0])
            if out is not None:
                return out[0].clone()
        return self._draft_eager(tokens, aux, num_pending, cur, tables, k)

    def _draft_eager(self, tokens, aux, num_pending, cur, tables, k: int) -> torch.Tensor:
        with self._ops():
            return draft_sample(_draft_logits(self, tokens, aux, num_pending, cur, tables, k), self.drafter_model.d2t)

    @torch.inference_mode()
    def draft_parallel_top(self, tokens, aux, num_pending, cur, tables, k: int, width: int):
        # as draft_parallel -> each position's top `width`: target ids [B, K, W], log-probs [B, K, W]
        with self._ops():
            logits = _draft_logits(self, tokens, aux, num_pending, cur, tables, k)
        logp, top = torch.log_softmax(logits.float(), dim=-1).topk(min(width, logits.shape[-1]), dim=-1)
        return self.drafter_model.to_target_ids(top), logp


def _draft_logits(ex, tokens, aux, num_pending, cur, tables, k: int) -> torch.Tensor:
    """The parallel pass of `ex` (a TorchExecutor, or an object lending its drafting methods) ->
    draft logits [B, K, V_d]; called inside ex._ops()."""
    d = ex.drafter_model
    embeds, hidden, positions, rows = draft_inputs(tokens, d.project(aux), num_pending, cur,
                                                   d.embed_tokens.weight, d.h_mask, k, ex.mask_token_id)
    x = d.forward_rows(embeds, hidden, positions, tables, ex.drafter_cache)  # [B, P+K-1, H]
    x = torch.gather(x, 1, rows[..., None].expand(-1, -1, x.shape[-1]))  # [B, K, H]
    return d.logits(x)  # [B, K, V_d]
