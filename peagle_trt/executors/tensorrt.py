"""TensorRTExecutor: the `Executor` interface (peagle_trt/speculative/executor.py) over the plans of
`peagle-trt engine`.

What: deserializes `<graph>.<arch>.plan` (target, drafter, drafter_step, drafter_fc; see
docs/EXPORT.md), creates one execution context per optimization profile, allocates every KV cache
ONCE as a torch CUDA tensor, paged [blocks + 1, block_size, KV, d] (the last block is the trash
block), and binds it to BOTH `past_*` and `present_*` of its layer (the attention plugin updates it
in place), then runs a forward by choosing the profile that fits the row count, `set_input_shape` +
`set_tensor_address` on torch tensors, and `execute_async_v3` on torch's current stream (no host
sync: results are torch tensors on it). Which blocks a request holds is the runtime's business
(peagle_trt/runtime/blocks.py): every forward gets block tables [G, B, M] (`block_tables` of the target plan;
the drafter plans take group 0's [B, M]). `kv` (a KVLayout) comes from the engine manifest (else
from the cache and table shapes of the plans); `windows` is (0,): the plugins have no sliding
windows, so the engine stage builds full-attention models only (one KV group).
Why: the Triton model and `generate --repo` step the same scheduler over any executor; this one
runs the engines instead of the torch reference.
How to test: only where TensorRT and a GPU exist (an NGC container): build the plans of a small
exported pair, then compare `target` / `draft_parallel` with `TorchExecutor` on the same prompts.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from peagle_trt.config import TENSORRT_NOT_DETERMINISTIC, KVLayout
from peagle_trt.errors import BuildError, ConfigError, RuntimeInvariantError
from peagle_trt.manifest import verify_manifest
from peagle_trt.models.kv_cache import move_rows
from peagle_trt.ops.reference import causal_tree_mask_on

log = logging.getLogger(__name__)

PAST, PRESENT = "past_", "present_"
TABLES = "block_tables"  # [G, B, M] in the target plan, [B, M] (group 0) in the drafter plans


def _torch_dtype(trt, dtype) -> torch.dtype:
    table = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16,
             trt.DataType.BF16: torch.bfloat16, trt.DataType.INT32: torch.int32,
             trt.DataType.INT64: torch.int64, trt.DataType.INT8: torch.int8,
             trt.DataType.UINT8: torch.uint8, trt.DataType.BOOL: torch.bool,
             trt.DataType.FP8: torch.float8_e4m3fn}
    if dtype not in table:
        raise RuntimeInvariantError(f"TensorRT I/O dtype {dtype} has no torch equivalent")
    return table[dtype]


class _Runner:
    """One plan: an execution context per profile, KV caches bound once, forwards on torch tensors."""

    def __init__(self, trt, runtime, path: Path, caches: dict[str, torch.Tensor], device: torch.device):
        self.path, self.device = path, device
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise BuildError(f"TensorRT could not load {path}: a plan runs only on the GPU architecture and "
                             "TensorRT version it was built with (and needs its plugin library); rebuild "
                             "it here with `peagle-trt engine`")
        self.engine = engine
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        is_input = {n: engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        self.dtypes = {n: _torch_dtype(trt, engine.get_tensor_dtype(n)) for n in names}
        self.kv = [n for n in names if is_input[n] and n.startswith(PAST)]
        self.inputs = [n for n in names if is_input[n] and n not in self.kv]
        self.outputs = [n for n in names if not is_input[n] and not n.startswith(PRESENT)]
        for name in self.kv:  # allocate once; a second plan over the same model shares them
            shape = tuple(engine.get_tensor_shape(name))
            if min(shape, default=0) < 0:  # left dynamic in the graph: the build fixed min = opt = max
                shape = tuple(engine.get_tensor_profile_shape(name, 0)[2])
            if name not in caches:
                caches[name] = torch.zeros(shape, dtype=self.dtypes[name], device=device)
            elif tuple(caches[name].shape) != shape:
                raise RuntimeInvariantError(f"{path}: {name} is {shape}, another plan of the model has "
                                            f"{tuple(caches[name].shape)}; rebuild all plans together")
        self.caches = {n: caches[n] for n in self.kv}
        unpaired = [n for n in self.kv if PRESENT + n[len(PAST):] not in names]
        if unpaired:
            raise RuntimeInvariantError(f"{path}: {unpaired} have no present_* output to alias "
                                        "(docs/EXPORT.md)")
        dynamic = [n for n in self.inputs if min(tuple(engine.get_tensor_shape(n)), default=0) < 0]
        self.declared = {n: tuple(engine.get_tensor_shape(n)) for n in self.inputs}  # -1: dynamic axes
        self.ranges = []  # per profile: {input: (min, max)}
        for p in range(engine.num_optimization_profiles):
            bounds = {n: engine.get_tensor_profile_shape(n, p) for n in dynamic}
            self.ranges.append({n: (tuple(b[0]), tuple(b[2])) for n, b in bounds.items()})
        # try the smallest profile first (decode before prefill)
        self.order = sorted(range(len(self.ranges)),
                            key=lambda p: sum(_volume(hi) for _, hi in self.ranges[p].values()))
        stream = _stream(device)
        self.contexts = []
        for p in range(max(1, len(self.ranges))):
            ctx = engine.create_execution_context()
            if p and not ctx.set_optimization_profile_async(p, stream):
                raise RuntimeInvariantError(f"{path}: cannot select optimization profile {p}")
            for name, cache in self.caches.items():
                if min(tuple(engine.get_tensor_shape(name)), default=0) < 0:
                    ctx.set_input_shape(name, tuple(cache.shape))
                # in place: the plugin reads past_* and writes present_* through the same pointer
                ctx.set_tensor_address(name, cache.data_ptr())
                ctx.set_tensor_address(PRESENT + name[len(PAST):], cache.data_ptr())
            self.contexts.append(ctx)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def _profile(self, shapes: dict[str, tuple]) -> int:
        for p in self.order:
            if all(len(shapes[n]) == len(lo) and all(a <= s <= b for s, a, b in zip(shapes[n], lo, hi))
                   for n, (lo, hi) in self.ranges[p].items()):
                return p
        if not self.ranges:
            return 0
        raise RuntimeInvariantError(f"{self.path.name}: input shapes {shapes} fit no optimization profile "
                                    f"{self.ranges}; rebuild the plans with larger --max-batch / "
                                    "--prefill-chunk or schedule smaller batches")

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if set(feeds) != set(self.inputs):
            raise RuntimeInvariantError(f"{self.path.name}: inputs {sorted(feeds)}, the plan expects "
                                        f"{self.inputs}")
        feeds = {n: t.to(device=self.device, dtype=self.dtypes[n]).contiguous() for n, t in feeds.items()}
        ctx = self.contexts[self._profile({n: tuple(t.shape) for n, t in feeds.items()})]
        for name, t in feeds.items():
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise RuntimeInvariantError(f"{self.path.name}: TensorRT rejected {name} of shape "
                                            f"{tuple(t.shape)}")
            ctx.set_tensor_address(name, t.data_ptr())
        outs = {}
        for name in self.outputs:
            shape = tuple(ctx.get_tensor_shape(name))
            if min(shape, default=0) < 0:
                raise RuntimeInvariantError(f"{self.path.name}: output {name} shape {shape} is unresolved")
            outs[name] = torch.empty(shape, dtype=self.dtypes[name], device=self.device)
            ctx.set_tensor_address(name, outs[name].data_ptr())
        # inputs stay referenced until enqueued; torch's allocator orders their reuse on this stream
        if not ctx.execute_async_v3(_stream(self.device)):
            raise RuntimeInvariantError(f"{self.path.name}: execute_async_v3 failed (see the TensorRT log)")
        return outs


def _stream(device: torch.device) -> int:
    """The handle of torch's current CUDA stream (0 off CUDA: only fakes run there, in tests)."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _volume(shape) -> int:
    v = 1
    for d in shape:
        v *= d
    return v


def _kv_layout(entry: dict, runners: dict[str, _Runner], caches: dict[str, torch.Tensor]) -> KVLayout:
    """The plans' KVLayout: the engine manifest's `kv` (written by the engine stage), checked against
    the caches; for an older manifest, from the cache shape [blocks + 1, bs, KV, d] and the profiles'
    block tables (M entries) and batch."""
    cache = next(iter(caches.values()))
    blocks, block_size = cache.shape[0] - 1, cache.shape[1]
    if entry.get("kv"):
        kv = KVLayout(**entry["kv"])
        if (kv.num_blocks, kv.block_size) != (blocks, block_size):
            raise RuntimeInvariantError(f"the engine manifest's KV layout {kv} disagrees with the plans' caches "
                                        f"{tuple(cache.shape)}; rebuild the engines")
        return kv
    target = runners["target"]
    tables = [hi for p in target.ranges for name, (_, hi) in p.items() if name == TABLES]
    entries = max((t[-1] for t in tables), default=0) or target.declared.get(TABLES, (0,))[-1]
    batch = max((t[-2] for t in tables), default=1)
    if entries < 1:
        raise RuntimeInvariantError(f"{target.path.name}: no {TABLES} input; rebuild the engines from a paged export")
    return KVLayout(blocks, entries * block_size, batch, block_size,
                    cache_dtype="fp8" if cache.dtype == torch.float8_e4m3fn else "auto")


class TensorRTExecutor:
    """Executor over TensorRT plans built by `peagle-trt engine` (one directory, one GPU arch).
    deterministic=True is refused (ConfigError, before anything loads): config.TENSORRT_NOT_DETERMINISTIC."""

    def __init__(self, engine_dir: str | Path, arch: str | None = None,
                 plugin_library: str | Path | None = None, d2t: torch.Tensor | None = None,
                 device: str | torch.device = "cuda", verify: bool = True, deterministic: bool = False):
        if deterministic:
            raise ConfigError(TENSORRT_NOT_DETERMINISTIC)
        from peagle_trt.engine import import_tensorrt, visible_gpu

        trt = import_tensorrt()
        engine_dir = Path(engine_dir)
        manifest = verify_manifest(engine_dir) if verify else _read_manifest(engine_dir)
        arch = arch or visible_gpu()[1]
        entry = manifest.get("engines", {}).get(arch)
        if entry is None:
            raise ConfigError(f"{engine_dir} holds plans for {sorted(manifest.get('engines', {}))}, not "
                              f"for this GPU ({arch}); build them here with `peagle-trt engine --gpu-arch "
                              f"{arch}`")
        library = plugin_library or (engine_dir / entry["plugin_library"]["path"]
                                     if entry.get("plugin_library") else None)
        if library is not None:  # before deserializing: the plans reference the plugin creators
            trt.get_plugin_registry().load_library(str(library))
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(self._logger)
        target_kv: dict[str, torch.Tensor] = {}
        drafter_kv: dict[str, torch.Tensor] = {}  # drafter and drafter_step share the drafter's cache
        self.runners = {g: _Runner(trt, runtime, engine_dir / e["plan"],
                                   target_kv if g == "target" else drafter_kv, self.device)
                        for g, e in entry["graphs"].items()}
        if "target" not in self.runners:
            raise ConfigError(f"{engine_dir}: no target plan for {arch}")
        if not target_kv:
            raise RuntimeInvariantError(f"{engine_dir}: the target plan has no past_* KV inputs (docs/EXPORT.md)")
        self.kv = _kv_layout(entry, self.runners, target_kv)
        self.windows = (0,)  # one KV group: the plugins (and so the engine stage) have no sliding windows
        groups = self.runners["target"].declared.get(TABLES, (1,))[0]
        if groups not in (-1, 1):
            raise RuntimeInvariantError(f"{engine_dir}: the target plan takes {groups} KV groups of block tables; "
                                        "the TensorRT plugins serve full-attention models only (one group)")
        self.num_spec_tokens = entry["spec"]["num_spec_tokens"]
        self.d2t = d2t.to(self.device) if d2t is not None else None

    # -- forwards ------------------------------------------------------------------------------
    def _runner(self, graph: str) -> _Runner:
        if graph not in self.runners:
            raise ConfigError(f"no {graph} plan was built (export {graph}.onnx and rerun "
                              "`peagle-trt engine`)")
        return self.runners[graph]

    def target(self, tokens, positions, tables, logit_rows=None, tree_mask=None):
        # tokens, positions [B, S]; tables [G, B, M] block tables; logit_rows [B, R] | None (all rows);
        # tree_mask [B, S, W] int32 | None (plain causal rows) -> logits [B, R or S, V] float32, aux [B, S, 3 * H_t]
        if logit_rows is None:
            logit_rows = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        if tree_mask is None:  # built on the device: a host copy per verify would wait for the stream
            tree_mask = causal_tree_mask_on(*tokens.shape, tokens.device)
        out = self._runner("target").run({"input_ids": tokens, "positions": positions, TABLES: tables,
                                          "logit_rows": logit_rows, "tree_mask": tree_mask.to(tokens.device)})
        return out["logits"], out["aux_hidden"]

    def move_kv(self, tables, src, dst):
        # tables [G, B, M]; src, dst [B, R] target KV positions: rows at src are copied to dst (-1: none)
        caches = self._runner("target").caches  # past_* name -> the cache buffer (one KV group here)
        keys = sorted(n for n in caches if n.startswith("past_key_"))
        move_rows([(caches[n], caches["past_value_" + n[len("past_key_"):]], tables[0].to(self.device)) for n in keys],
                  src.to(self.device), dst.to(self.device))

    def draft_parallel(self, tokens, aux, num_pending, cur, tables, k: int) -> torch.Tensor:
        # tokens [B, P], aux [B, P, 3 * H_t], num_pending, cur [B], tables [G, B, M] -> draft ids [B, k]
        # k <= K (the K of the plan): the length of `draft_slots` makes the plan run k mask rows
        if not 1 <= k <= self.num_spec_tokens:
            raise RuntimeInvariantError(f"asked for {k} drafts; the drafter plan was built for "
                                        f"K = {self.num_spec_tokens}")
        return self._draft(tokens, aux, num_pending, cur, tables, k, 1)["draft_ids"].long()

    def draft_parallel_top(self, tokens, aux, num_pending, cur, tables, k: int, width: int):
        # as draft_parallel -> each position's top `width` (target ids [B, k, W], log-probs [B, k, W])
        out = self._draft(tokens, aux, num_pending, cur, tables, k, width)
        return out["top_ids"].long(), out["top_logp"].float()

    def _draft(self, tokens, aux, num_pending, cur, tables, k: int, width: int) -> dict:
        slots = torch.zeros(k, dtype=torch.int64, device=tokens.device)
        widths = torch.zeros(width, dtype=torch.int64, device=tokens.device)  # only its length counts
        return self._runner("drafter").run({"pending_ids": tokens, "pending_aux": aux, "num_pending": num_pending,
                                            "cur": cur, "draft_slots": slots, "draft_width": widths,
                                            TABLES: tables[0]})

    def drafter(self, tokens, hidden, positions, tables):
        # tokens, positions [B, S]; hidden [B, S, H]; tables [G, B, M] (the drafter reads group 0)
        # -> draft logits [B, S, V_d], pre-norm [B, S, H]
        out = self._runner("drafter_step").run({"input_ids": tokens, "hidden": hidden,
                                                "positions": positions, TABLES: tables[0]})
        return out["logits"], out["hidden_out"]

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        # [..., rows, 3 * H_t] -> [..., rows, H]; the plan takes [batch, rows, 3 * H_t]
        x = aux[None] if aux.dim() == 2 else aux
        hidden = self._runner("drafter_fc").run({"aux": x})["hidden"]
        return hidden[0] if aux.dim() == 2 else hidden

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.d2t is None:
            raise ConfigError("TensorRTExecutor needs the drafter's d2t table (draft -> target vocabulary) "
                              "for eagle3 mode; pass d2t= from the drafter checkpoint")
        return draft_ids + self.d2t[draft_ids]


def _read_manifest(engine_dir: Path) -> dict:
    import json

    try:
        return json.loads((engine_dir / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{engine_dir}: no readable manifest.json ({exc}); build it with "
                          "`peagle-trt engine`") from exc
