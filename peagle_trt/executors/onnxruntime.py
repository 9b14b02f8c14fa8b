"""onnxruntime executor: runs the exported graphs (docs/EXPORT.md) behind the `Executor` interface.

The custom `peagle` nodes run through their model-local function bodies, so the very files that
go to TensorRT (minus those functions) are what this executor validates on a CPU. KV caches are
paged host arrays per layer ([blocks + 1, block_size, kv_heads, head_dim], peagle_trt/models/kv_cache.py),
allocated once and bound through IO binding as both `past_*` and `present_*`: the graph's
ScatterND writes the new rows into that very buffer (no per-step cache copy) and attention
gathers only the blocks of the batch's requests, through the block tables. Other outputs (logits, taps) are allocated by
onnxruntime per run and handed over without a copy. An FP8 KV cache (KVLayout.cache_dtype "fp8") is a
uint8 array of E4M3 bit patterns: ONNX has no ScatterND / Gather on float8, so the graphs store and read
codes that way (peagle_trt/ops/onnx_defs.py); they are the bytes torch's float8_e4m3fn cache holds.

Threads: every session of the process runs on ONE intra-op thread pool (`_thread_pool`). With a
pool per session, the pool of the graph that just ran keeps spinning and takes the cores from the
next graph: on 2 cores a target verify right after a drafter pass took 24-28 ms instead of 16-18
(docs/BENCHMARKS.md, "One thread pool for the target and the drafter").

Deterministic mode (`OrtExecutor(..., deterministic=True)`): a request's logits do not depend on
its batch, its draft count or the thread count. Measured (onnxruntime 1.32.0, MLAS, 2026-11-26):
a float32 MatMul row is bitwise the same for every M >= 2 rows but not for M = 1 (a different
kernel), and the zero-padded key axis of attention (MatMul over L, Softmax with -inf) changes
nothing; MLAS splits a GEMM over threads by rows or columns, never along the reduction, so the
thread count changes no bit either (measured 1 vs 2 threads). So every forward that would give a
GEMM a single row (a batch-1 decode, a one-row projection or head) gets one padding row (position
-1: it writes to the trash block and is sliced off), and the sessions split work statically
(`session.dynamic_block_base` 0). Checked by tests/executors/test_deterministic.py, thread counts
included (a second process with another pool size).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from peagle_trt.config import KVLayout
from peagle_trt.errors import ConfigError
from peagle_trt.manifest import verify_manifest
from peagle_trt.models.kv_cache import move_rows
from peagle_trt.ops.reference import causal_tree_mask

_POOL: dict = {}  # the process's onnxruntime thread pool, once made: {"threads": int | None}
# KV cache arrays by the graph's cache type; uint8: an FP8 cache's E4M3 bit patterns (ops/onnx_defs.py)
_KV_ARRAYS = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(uint8)": np.uint8}


def _thread_pool(threads: int | None) -> None:
    """Make the process-wide intra-op pool on first use (`threads`; None: onnxruntime's default,
    the physical cores). It cannot be resized: a later, different explicit count is refused."""
    import onnxruntime as ort

    if not _POOL:
        ort.set_global_thread_pool_sizes(threads or 0, 1)
        _POOL["threads"] = threads
    elif threads is not None and threads != _POOL["threads"]:
        made = _POOL["threads"] or "onnxruntime's default number of"
        raise ConfigError(f"this process's onnxruntime thread pool has {made} threads, shared by every "
                          f"session; asked for {threads}: pass the same thread count to every executor of "
                          "a process (or none), or run the other one in its own process")


def session_options(weights: dict | None = None):
    """Every session's options but its threads: `weights` {name: array} are the large initializers
    of an in-memory model, as OrtValues over these arrays (no copy)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if weights:
        options.add_external_initializers(list(weights),
                                          [ort.OrtValue.ortvalue_from_numpy(a) for a in weights.values()])
    # onnxruntime's integer QDQ fusion does not know FP8: keep Q/DQ -> MatMul as written.
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    return options


def _session(path: Path | bytes, threads: int | None, weights: dict | None = None, deterministic: bool = False):
    import onnxruntime as ort

    _thread_pool(threads)
    options = session_options(weights)
    options.use_per_session_threads = False  # the shared pool (module docstring)
    if deterministic:  # a static split of each op's work over the pool (the default; said, not assumed)
        options.add_session_config_entry("session.dynamic_block_base", "0")
    source = path if isinstance(path, bytes) else str(path)  # bytes: a serialized in-memory model
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _in_memory(model) -> tuple[bytes, dict]:
    """(serialized `model` without its large float initializers, {name: array} of those): the
    session takes the arrays as external initializers, sparing a 0.5 GB protobuf round trip."""
    from onnx import TensorProto, numpy_helper

    weights = {}
    for init in model.graph.initializer:
        if init.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16) and len(init.raw_data) >= 1 << 16:
            weights[init.name] = numpy_helper.to_array(init)
            init.ClearField("raw_data")
            init.data_location = TensorProto.EXTERNAL  # resolved by add_external_initializers
            entry = init.external_data.add()
            entry.key, entry.value = "location", "in-memory"
    return model.SerializeToString(), weights


class _Graph:
    """One session plus its KV state: each `past_*` input and its `present_*` output are bound to
    the same host buffer (`kv`, allocated once; `shared` reuses another graph's buffers)."""

    def __init__(self, path_or_model, threads: int | None, shared: dict | None = None, deterministic: bool = False):
        # path_or_model: an .onnx path, or a ModelProto (made in memory)
        self.weights = {}  # kept alive with the session
        if not isinstance(path_or_model, Path):
            path_or_model, self.weights = _in_memory(path_or_model)
        self.session = _session(path_or_model, threads, self.weights, deterministic)
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.inputs = {i.name for i in self.session.get_inputs()}
        self.kv = shared if shared is not None else {
            i.name: np.zeros(list(i.shape), dtype=_KV_ARRAYS[i.type])
            for i in self.session.get_inputs() if i.name.startswith("past_")}
        self.binding = self.session.io_binding()
        self.plain = [o for o in self.outputs if not o.startswith("present_")]
        for name, array in self.kv.items():
            self._bind_kv(name, array)

    def _bind_kv(self, name: str, array: np.ndarray) -> None:
        import onnxruntime as ort

        value = ort.OrtValue.ortvalue_from_numpy(array)  # wraps the array's memory (CPU: no copy)
        self.binding.bind_ortvalue_input(name, value)
        self.binding.bind_ortvalue_output("present_" + name[len("past_"):], value)

    def run(self, feeds: dict) -> dict:
        for name, array in feeds.items():
            self.binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name in self.plain:  # re-bound each run: a fresh buffer, never last run's arrays
            self.binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(self.binding)
        values = self.binding.get_outputs()  # in binding order: KV (bound first, kept), then `plain`
        return {name: v.numpy() for name, v in zip(self.plain, values[len(self.kv):])}


def _two_rows(x: torch.Tensor, fill: int) -> torch.Tensor:
    """x [B, 1, ...] -> [B, 2, ...] with a second row of `fill`; wider x unchanged (module docstring)."""
    return x if x.shape[1] > 1 else torch.cat([x, torch.full_like(x, fill)], 1)


class OrtExecutor:
    def __init__(self, export_dir: str | Path, threads: int | None = None, verify: bool = True,
                 deterministic: bool = False):
        export_dir = Path(export_dir)
        manifest = verify_manifest(export_dir) if verify else json.loads((export_dir / "manifest.json").read_text())
        info = manifest["export"]
        if "kv" not in info:
            raise ConfigError(f"{export_dir} was exported before the KV cache was paged; export it again")
        self.kv, self.windows = KVLayout(**info["kv"]), tuple(info["windows"])
        self.num_spec_tokens = info["spec"]["num_spec_tokens"]
        self.device = torch.device("cpu")
        self.mask_token_id = None  # baked into drafter.onnx
        graphs, det = set(manifest["graphs"]), deterministic
        self.deterministic = deterministic
        self.g_target = _Graph(export_dir / "target.onnx", threads, None, det)
        self.g_drafter = _Graph(export_dir / "drafter.onnx", threads, None, det) if "drafter" in graphs else None
        shared = self.g_drafter.kv if self.g_drafter is not None else None  # one drafter KV cache
        step = export_dir / "drafter_step.onnx"
        self.g_step = _Graph(step, threads, shared, det) if "drafter_step" in graphs else None
        self.g_fc = _Graph(export_dir / "drafter_fc.onnx", threads, None, det) if "drafter_fc" in graphs else None
        self.d2t = torch.from_numpy(np.load(export_dir / "d2t.npy")) if (export_dir / "d2t.npy").is_file() else None

    @classmethod
    def from_models(cls, target, drafter=None, spec=None, kv: KVLayout | int = 1, max_len: int = 2048,
                    threads: int | None = None, deterministic: bool = False) -> OrtExecutor:
        """Executor over built torch models (`TargetModel`, `DrafterModel` | None), their graphs
        made in memory, no files: what `export` would write (float32), for `spec` (SpecConfig;
        None: target only), caches laid out by `kv` (or N: room for N requests of `max_len`
        positions). `generate --target` runs this on CPU (docs/BENCHMARKS.md, decode speed)."""
        from peagle_trt.export.graphs import export_drafter, export_drafter_fc, export_drafter_step, export_target
        from peagle_trt.ops.onnx_defs import register_schemas

        register_schemas()
        self = cls.__new__(cls)
        self.kv = kv if isinstance(kv, KVLayout) else KVLayout.for_sequences(kv, max_len)
        self.windows = target.kv_windows
        k = spec.num_spec_tokens if spec is not None else 0
        self.num_spec_tokens, self.device, self.mask_token_id = k, torch.device("cpu"), None
        self.deterministic = det = deterministic
        self.g_target = _Graph(export_target(target, self.kv), threads, None, det)
        self.g_drafter = self.g_step = self.g_fc = self.d2t = None
        if drafter is None or not k:
            return self
        if spec.mode == "peagle":
            self.g_drafter = _Graph(export_drafter(drafter, self.kv, k), threads, None, det)
        shared = self.g_drafter.kv if self.g_drafter is not None else None
        self.g_step = _Graph(export_drafter_step(drafter, self.kv), threads, shared, det)
        self.g_fc = _Graph(export_drafter_fc(drafter), threads, None, det)
        self.d2t = drafter.d2t.cpu().to(torch.int64)
        return self

    def target(self, tokens, positions, tables, logit_rows=None, tree_mask=None):
        # tokens, positions [B, S]; tables [G, B, M] block tables; logit_rows [B, R] | None (all rows);
        # tree_mask [B, S, W] int32 | None (plain causal rows)
        s = tokens.shape[1]
        if logit_rows is None:
            logit_rows = torch.arange(s).expand(tokens.shape[0], -1)
        r = logit_rows.shape[1]
        if self.deterministic:  # no one-row GEMM (module docstring); the extra rows are sliced off
            tokens, positions, logit_rows = _two_rows(tokens, 0), _two_rows(positions, -1), _two_rows(logit_rows, 0)
            tree_mask = None if tree_mask is None else _two_rows(tree_mask, 0)
        feeds = {"input_ids": tokens.numpy(), "positions": positions.numpy(), "block_tables": tables.numpy(),
                 "logit_rows": logit_rows.contiguous().numpy()}
        if "tree_mask" in self.g_target.inputs:  # full-attention targets (trees are refused with windows)
            feeds["tree_mask"] = causal_tree_mask(*tokens.shape) if tree_mask is None else tree_mask.numpy()
        elif tree_mask is not None:
            raise ConfigError("this target.onnx takes no tree_mask (sliding-window targets verify chains only)")
        out = self.g_target.run(feeds)
        return torch.from_numpy(out["logits"][:, :r]), torch.from_numpy(out["aux_hidden"][:, :s])

    def move_kv(self, tables, src, dst):
        # tables [G, B, M]; src, dst [B, R] target KV positions: rows at src are copied to dst (-1: none).
        # Draft trees run on full-attention targets (one KV group: group 0's tables for every layer)
        layers = [(torch.from_numpy(self.g_target.kv[f"past_key_{i}"]),
                   torch.from_numpy(self.g_target.kv[f"past_value_{i}"]), tables[0])
                  for i in sorted(int(n.rsplit("_", 1)[1]) for n in self.g_target.kv if n.startswith("past_key_"))]
        move_rows(layers, src, dst)

    def draft_parallel(self, tokens, aux, num_pending, cur, tables, k: int) -> torch.Tensor:
        if self.g_drafter is None:
            raise ConfigError("this export has no drafter.onnx (parallel drafting); re-export in peagle mode")
        # k <= K (the K of the export): the length of `draft_slots` makes the graph run k mask rows
        if not 1 <= k <= self.num_spec_tokens:
            raise ConfigError(f"drafter.onnx was exported for K={self.num_spec_tokens}, asked for {k} drafts; "
                              "re-export")
        return torch.from_numpy(self._draft(tokens, aux, num_pending, cur, tables, k, 1)["draft_ids"])

    def draft_parallel_top(self, tokens, aux, num_pending, cur, tables, k: int, width: int):
        # as draft_parallel -> each position's top `width` (target ids [B, k, W], log-probs [B, k, W])
        out = self._draft(tokens, aux, num_pending, cur, tables, k, width)
        return torch.from_numpy(out["top_ids"]), torch.from_numpy(out["top_logp"])

    def _draft(self, tokens, aux, num_pending, cur, tables, k: int, width: int) -> dict:
        if self.deterministic:  # two pending rows at least: the graph's fc projects them on their own
            tokens, aux = _two_rows(tokens, 0), _two_rows(aux, 0)
        return self.g_drafter.run({"pending_ids": tokens.numpy(), "pending_aux": aux.numpy(),
                                   "num_pending": num_pending.numpy(), "cur": cur.numpy(),
                                   "draft_slots": np.zeros(k, np.int64), "draft_width": np.zeros(width, np.int64),
                                   "block_tables": tables[0].numpy()})

    def drafter(self, tokens, hidden, positions, tables):
        s = tokens.shape[1]
        if self.deterministic:
            tokens, hidden, positions = _two_rows(tokens, 0), _two_rows(hidden, 0), _two_rows(positions, -1)
        out = self.g_step.run({"input_ids": tokens.numpy(), "hidden": hidden.contiguous().numpy(),
                               "positions": positions.numpy(), "block_tables": tables[0].numpy()})
        return torch.from_numpy(out["logits"][:, :s]), torch.from_numpy(out["hidden_out"][:, :s])

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        flat = aux.reshape(1, -1, aux.shape[-1]) if aux.dim() == 2 else aux
        n = flat.shape[1]
        if self.deterministic:
            flat = _two_rows(flat, 0)
        hidden = torch.from_numpy(self.g_fc.run({"aux": flat.contiguous().numpy()})["hidden"][:, :n])
        return hidden.reshape(*aux.shape[:-1], hidden.shape[-1])

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
