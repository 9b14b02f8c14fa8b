"""Stage `engine`: TensorRT plans from the export directory's TensorRT graphs.

    peagle-trt engine --export-dir EXPORT --output ENGINES --gpu-arch sm_90 [--plugin-library LIB.so]

What: every graph of EXPORT/trt/ (target.onnx, drafter.onnx and, when present, drafter_step.onnx /
drafter_fc.onnx) is parsed from its file (so `<graph>.onnx.data` resolves) into a strongly typed
network, with the PEagle plugin library loaded into the plugin registry first (the ONNX parser maps
a node to the plugin creator registered under its op_type), gets the optimization profiles of
docs/EXPORT.md (`profiles_for`), and is built into `ENGINES/<graph>.<arch>.plan`; `manifest.json`
records TensorRT / CUDA versions, the GPU, the profiles and the export manifest's hash.
Why: TensorRT builds for the GPU it runs on (sm_90 plans on H100/H200, sm_100 on B200), so this
stage runs once per architecture where TensorRT exists (an NGC container, see docker/); plans of the
other architecture already in ENGINES are kept. The output is written to a temporary sibling and
renamed into place, so a failed build leaves nothing behind.
How to test: `pytest tests/engine` (no TensorRT: a fake `tensorrt` module records the calls); on a GPU
with TensorRT, build the plans and serve them with `peagle_trt.executors.tensorrt`.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from peagle_trt.atomic import check_output, staged_dir
from peagle_trt.config import BLOCK_SIZE, KVLayout
from peagle_trt.errors import BuildError, ConfigError
from peagle_trt.manifest import MANIFEST, sha256, verify_manifest, write_manifest
from peagle_trt.ops.names import DRAFT_INPUTS, KV_ATTENTION, OP_TYPES, PLUGIN_NAMESPACE, PLUGIN_VERSION

log = logging.getLogger(__name__)

ARCHES = {"sm_90": "H100/H200 (Hopper)", "sm_100": "B200 (Blackwell)"}
GRAPHS = ("target", "drafter", "drafter_step", "drafter_fc")
PLUGIN_OPS = OP_TYPES  # plugin names = op_types, version and namespace: peagle_trt/ops/names.py
KV_PREFIXES = ("past_key_", "past_value_")
NGC_HINT = ("TensorRT is not installed in this Python environment, and it cannot be pip-installed on "
            "every machine. Build and run TensorRT plans inside an NVIDIA NGC container on the GPU the "
            "plans are for: nvcr.io/nvidia/tritonserver:<yy.mm>-py3 (see docker/Dockerfile) or "
            "nvcr.io/nvidia/tensorrt:<yy.mm>-py3; or install the wheels from NVIDIA's index with "
            "`pip install tensorrt-cu13` (tensorrt-cu12 for CUDA 12), matching your CUDA and driver.")

# Axes of every non-KV input (docs/EXPORT.md); None = a static size (hidden width, KV groups) taken from
# the graph; FIXED symbols may be static or dynamic in the graph but take one size in every profile.
AXES = {
    "target": {"input_ids": ("batch", "rows"), "positions": ("batch", "rows"),
               "block_tables": (None, "batch", "blocks"), "logit_rows": ("batch", "logit_rows"),
               "tree_mask": ("batch", "rows", "mask_words")},
    "drafter": {"pending_ids": ("batch", "pending"), "pending_aux": ("batch", "pending", None),
                "num_pending": ("batch",), "cur": ("batch",), "draft_slots": ("drafts",),
                "draft_width": ("width",), "block_tables": ("batch", "blocks")},
    "drafter_step": {"input_ids": ("batch", "rows"), "hidden": ("batch", "rows", None),
                     "positions": ("batch", "rows"), "block_tables": ("batch", "blocks")},
    "drafter_fc": {"aux": ("batch", "rows", None)},
}
FIXED = ("blocks",)  # M = ceil(max_len / block_size) block-table entries per request


def import_tensorrt():
    """`import tensorrt`, or a BuildError naming the container to use."""
    try:
        import tensorrt
    except (ImportError, OSError) as exc:  # OSError: a stub wheel without its shared libraries
        raise BuildError(f"{NGC_HINT} (import tensorrt: {exc})") from exc
    return tensorrt


@dataclass(frozen=True)
class EngineOptions:
    gpu_arch: str = "sm_90"  # sm_90 (H100/H200) | sm_100 (B200)
    max_batch: int = 8  # concurrent requests (a batch's rows)
    max_seq_len: int = 2048  # prompt + generated tokens
    num_spec_tokens: int = 7  # K, fixed in the exported drafter
    prefill_chunk: int = 256  # prompt tokens per prefill forward
    plugin_library: Path | None = None  # the PEagle plugins (plugins/, CMake)
    workspace_gb: float = 8.0  # builder workspace pool
    timing_cache: Path | None = None  # None: ~/.cache/peagle-trt/timing-<arch>.cache
    allow_arch_mismatch: bool = False  # build an Ampere+ hardware-compatible plan on another GPU
    block_size: int = BLOCK_SIZE  # positions per KV block
    kv_blocks: int = 0  # KV blocks (the trash block aside); 0: max_batch requests of the full length
    max_nodes: int = 0  # draft tokens one verify checks (a draft tree's nodes); 0: K
    tree_width: int = 1  # candidates per draft position the drafter plan returns (a tree's; 1: chains)

    def __post_init__(self):
        if self.gpu_arch not in ARCHES:
            raise BuildError(f"--gpu-arch {self.gpu_arch!r} is not supported; choose from {sorted(ARCHES)}")
        if (self.max_batch < 1 or self.max_seq_len < 2 or self.prefill_chunk < 1 or self.workspace_gb <= 0
                or self.block_size < 1 or self.kv_blocks < 0):
            raise BuildError("max_batch, max_seq_len, prefill_chunk, block_size and workspace_gb must be positive "
                             "(kv_blocks >= 0)")
        if not 0 <= self.num_spec_tokens <= 64:
            raise BuildError(f"num_spec_tokens must be in [0, 64], got {self.num_spec_tokens}")
        if self.kv_blocks and self.kv_blocks < self.kv_layout.max_blocks:
            raise BuildError(f"--kv-blocks {self.kv_blocks} cannot hold one request of --max-seq-len "
                             f"{self.max_seq_len} (it needs {self.kv_layout.max_blocks} blocks of {self.block_size})")

    @property
    def max_len(self) -> int:
        """KV positions per request: max_seq_len + a verify's rows as headroom (as the runtime's)."""
        return self.max_seq_len + self.verify_rows

    @property
    def verify_rows(self) -> int:
        """Rows of a verify: the last token + K drafts, or + a draft tree's nodes."""
        return max(self.num_spec_tokens, self.max_nodes) + 1

    @property
    def kv_layout(self) -> KVLayout:
        """The paged KV cache the plans are built for (serving.options.RepositoryOptions.kv_layout)."""
        try:
            if not self.kv_blocks:
                return KVLayout.for_sequences(self.max_batch, self.max_len, self.block_size, max_rows=self.max_rows)
            return KVLayout(self.kv_blocks, self.max_len, self.max_batch, self.block_size, self.max_rows)
        except ConfigError as exc:
            raise BuildError(str(exc)) from exc

    @property
    def max_rows(self) -> int:
        """Rows of a drafter forward: a prefill chunk, or the n <= K+1 pending rows after a verify."""
        return max(self.prefill_chunk, self.num_spec_tokens + 1)

    def timing_cache_path(self) -> Path:
        if self.timing_cache is not None:
            return Path(self.timing_cache)
        return Path.home() / ".cache" / "peagle-trt" / f"timing-{self.gpu_arch}.cache"


# -- optimization profiles (pure) -------------------------------------------------------------------
def _ranges(graph: str, spec: EngineOptions) -> dict[str, dict[str, tuple[int, int, int]]]:
    """(min, opt, max) of every symbolic axis, per profile."""
    n, k1, rows = spec.max_batch, spec.num_spec_tokens + 1, spec.max_rows
    m = spec.kv_layout.max_blocks
    blocks = (m, m, m)
    if graph == "target":
        chunk, v = spec.prefill_chunk, spec.verify_rows  # tree_mask: ceil(rows / 32) words per row
        return {"prefill": {"batch": (1, 1, n), "rows": (1, chunk, chunk), "logit_rows": (1, 1, 1),
                            "mask_words": (1, -(-chunk // 32), -(-chunk // 32)), "blocks": blocks},
                "decode": {"batch": (1, n, n), "rows": (1, v, v), "logit_rows": (1, v, v),
                           "mask_words": (1, -(-v // 32), -(-v // 32)), "blocks": blocks}}
    if graph == "drafter":
        w = max(spec.tree_width, 1)
        return {"draft": {"batch": (1, n, n), "pending": (1, min(k1, rows), rows),
                          "drafts": (1, k1 - 1, k1 - 1), "width": (1, 1, w), "blocks": blocks}}
    # drafter_step: K-1 of the K sequential passes have one row; drafter_fc projects pending rows
    return {"rows": {"batch": (1, n, n), "rows": (1, 1 if graph == "drafter_step" else min(k1, rows), rows),
                     "blocks": blocks}}


def _static(dim) -> bool:
    return isinstance(dim, int) and dim >= 0


def _kv_shape(graph: str, name: str, dims: list, spec: EngineOptions) -> list[int]:
    """[blocks + 1, block_size, KV, d] (paged, the last block is the trash block): KV heads and
    head_dim from the graph, the block count and size from the spec."""
    if len(dims) != 4 or not (_static(dims[2]) and _static(dims[3])):
        raise BuildError(f"{graph}.onnx input {name} has shape {dims}; expected [blocks + 1, block_size, kv_heads, "
                         "head_dim] with static kv_heads and head_dim (docs/EXPORT.md); re-export")
    kv = spec.kv_layout
    want = [kv.num_blocks + 1, kv.block_size, dims[2], dims[3]]
    what = {0: "blocks + 1 = (--kv-blocks, else --max-batch x ceil((--max-seq-len + K + 1) / --block-size)) + 1",
            1: "--block-size"}
    for axis in (0, 1):
        if _static(dims[axis]) and dims[axis] != want[axis]:
            raise BuildError(f"{graph}.onnx input {name} was exported with axis {axis} = {dims[axis]} but "
                             f"{what[axis]} gives {want[axis]}; build with the export's sizes or re-export")
    return want


def profiles_for(graph: str, spec: EngineOptions, shapes: dict[str, list]) -> dict[str, dict[str, dict]]:
    """The optimization profiles of one graph: {profile: {input: {"min", "opt", "max"}}}.

    `shapes` maps every network input to its dims (int = static; -1, None or a name = dynamic).
    target: prefill (batch 1..N, rows 1..prefill_chunk, logit_rows 1) and decode / verify (batch 1..N,
    rows and logit_rows 1..K+1, or a draft tree's nodes + 1; tree_mask words ceil(rows / 32)); drafter:
    pending 1..max(prefill_chunk, K+1), drafts 1..K, draft_width 1..tree_width, batch 1..N (N = max_batch).
    Block tables ([G, batch, M] target, [batch, M] drafters) have M = ceil(max_len / block_size)
    entries in every profile; KV inputs are fixed [blocks + 1, block_size, KV, d].
    """
    if graph not in AXES:
        raise BuildError(f"unknown graph {graph!r}; expected one of {GRAPHS}")
    axes = AXES[graph]
    kv = {k: list(v) for k, v in shapes.items() if k.startswith(KV_PREFIXES)}
    names = set(shapes) - set(kv)
    if names != set(axes):
        raise BuildError(f"{graph}.onnx inputs do not follow docs/EXPORT.md: missing "
                         f"{sorted(set(axes) - names)}, unexpected {sorted(names - set(axes))}; re-export")
    fixed = {k: _kv_shape(graph, k, v, spec) for k, v in sorted(kv.items())}
    profiles = {}
    for profile, ranges in _ranges(graph, spec).items():
        entry = {}
        for name, symbols in axes.items():
            dims = list(shapes[name])
            if len(dims) != len(symbols):
                raise BuildError(f"{graph}.onnx input {name} has rank {len(dims)}, expected {len(symbols)}")
            lo, opt, hi = [], [], []
            for axis, (sym, dim) in enumerate(zip(symbols, dims)):
                if sym is None and not _static(dim):
                    raise BuildError(f"{graph}.onnx input {name} axis {axis} must be static (a hidden size or "
                                     f"the KV groups), got {dim!r}; re-export")
                if sym in FIXED and _static(dim) and dim != ranges[sym][0]:
                    raise BuildError(f"{graph}.onnx input {name} axis {axis} ({sym}) was exported as {dim} but "
                                     f"the KV layout gives {ranges[sym][0]} (ceil((--max-seq-len + K + 1) / "
                                     "--block-size)); build with the export's sizes or re-export")
                if sym is not None and sym not in FIXED and _static(dim):
                    raise BuildError(f"{graph}.onnx input {name} axis {axis} ({sym}) must be dynamic, got "
                                     f"{dim}; re-export with dynamic {sym}")
                a, b, c = (dim, dim, dim) if sym is None else ranges[sym]
                lo.append(a), opt.append(b), hi.append(c)
            entry[name] = {"min": lo, "opt": opt, "max": hi}
        entry.update({k: {"min": v, "opt": v, "max": v} for k, v in fixed.items()})
        profiles[profile] = entry
    return profiles


# -- environment -------------------------------------------------------------------------------------
def visible_gpu() -> tuple[str, str]:
    """(name, arch) of the current CUDA device, e.g. ("NVIDIA H200", "sm_90")."""
    import torch

    if not torch.cuda.is_available():
        raise BuildError("no CUDA GPU is visible (torch.cuda.is_available() is False); TensorRT builds "
                         "plans on the GPU they are for: run on an H100/H200 (sm_90) or B200 (sm_100) "
                         "with `docker run --gpus all`")
    major, minor = torch.cuda.get_device_capability()
    return torch.cuda.get_device_name(), f"sm_{major}{minor}"


def cuda_version() -> str | None:
    import torch

    if getattr(torch.version, "cuda", None):
        return torch.version.cuda
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError:
            return None
    err, version = cudart.cudaRuntimeGetVersion()
    return f"{version // 1000}.{(version % 1000) // 10}" if int(err) == 0 else None


def check_arch(spec: EngineOptions, visible: str) -> None:
    if spec.gpu_arch == visible or spec.allow_arch_mismatch:
        return
    raise BuildError(f"--gpu-arch {spec.gpu_arch} but the visible GPU is {visible}: TensorRT builds a plan "
                     "for the GPU it runs on, so build sm_90 plans on an H100/H200 and sm_100 plans on a "
                     "B200. --allow-arch-mismatch builds an Ampere+ hardware-compatible plan here instead "
                     "(slower, and the plugin library must carry kernels for both architectures)")


def _graph_info(path: Path) -> dict:
    """Plugin ops used and the drafter's K, read from the ONNX file (no weights); {} without onnx."""
    try:
        import onnx
        from onnx import helper
    except ImportError:
        log.warning("onnx is not installed: skipping the plugin / K checks of %s", path)
        return {}
    model = onnx.load(str(path), load_external_data=False)
    local = sorted(f.name for f in model.functions if f.name in PLUGIN_OPS)
    if local:
        raise BuildError(f"{path} carries model-local functions {local}: TensorRT's parser would inline "
                         "them instead of using the plugins; build from the export's trt/ graphs")
    ops = sorted({n.op_type for n in model.graph.node if n.op_type in PLUGIN_OPS})
    extended = [n.name for n in model.graph.node if n.op_type == KV_ATTENTION and (
        any(a.name == "sliding_window" and helper.get_attribute_value(a) for a in n.attribute)
        or (len(n.input) > 7 and n.input[7] not in ("", "tree_mask")))]  # sliding windows / attention sinks
    # (the TensorRT copy's 8th input is the target graph's tree_mask: ops.onnx_defs.strip_functions)
    attn = [n for n in model.graph.node if n.op_type == KV_ATTENTION]
    caches_out = {name for n in attn for name in n.output[1:]}
    shared = [n.name for n in attn if n.input[5] in caches_out]  # Gemma-4 KV-shared layers
    if extended or shared:
        more = " ..." if len(extended) > 4 else ""
        what = ([f"attention nodes {extended[:4]}{more} use sliding windows or attention sinks, which the "
                 "TensorRT plugins (plugins/) do not implement"] if extended else [])
        what += ([f"attention nodes {shared[:4]} read another layer's KV cache (KV-shared layers), which the "
                  "TensorRT plugins' in-place cache binding is not verified for"] if shared else [])
        raise BuildError(f"{path}: {'; '.join(what)}; serve this model with --backend torch or onnxruntime "
                         "(a drafter window W is left out of the export when max_seq_len + K + 1 <= W)")
    k = [helper.get_attribute_value(a) for n in model.graph.node if n.op_type == DRAFT_INPUTS
         for a in n.attribute if a.name == "num_spec_tokens"]
    return {"plugin_ops": ops, "num_spec_tokens": int(k[0]) if k else None}


def _make_logger(trt):
    class Logger(trt.ILogger):
        """Forwards TensorRT messages to logging and keeps the errors for BuildError messages."""

        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, msg):
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                self.errors.append(msg)
                log.error("TensorRT: %s", msg)
            elif severity == trt.ILogger.Severity.WARNING:
                log.warning("TensorRT: %s", msg)
            else:
                log.debug("TensorRT: %s", msg)

    return Logger()


def load_plugins(trt, library: Path, ops: list[str]) -> None:
    """Load the plugin library into TensorRT's registry and check it registers every op used.

    `IPluginRegistry::loadLibrary` returns nullptr (Python: None) when any of the library's plugins is
    already registered, e.g. on a second build in one process: a registry that already serves every
    op is used as it is."""
    if not Path(library).is_file():
        raise BuildError(f"plugin library {library} not found; build it with CMake from plugins/ "
                         "(docker/Dockerfile does) and pass --plugin-library")
    registry = trt.get_plugin_registry()

    def missing() -> list[str]:
        return [op for op in ops if registry.get_creator(op, PLUGIN_VERSION, PLUGIN_NAMESPACE) is None]

    if ops and not missing():
        log.info("the PEagle plugins are already registered; not loading %s again", library)
        return
    try:
        handle = registry.load_library(str(library))
    except Exception as exc:  # the binding raises on a library TensorRT cannot load
        raise BuildError(f"TensorRT could not load the plugin library {library} ({exc}); rebuild it "
                         "against this TensorRT version") from exc
    if handle is None:  # loadLibrary's nullptr
        raise BuildError(f"TensorRT refused the plugin library {library} (loadLibrary returned no handle: "
                         "another library already registers one of its plugins, or it was built against "
                         "another TensorRT); see the TensorRT log above")
    if missing():
        raise BuildError(f"plugin library {library} registers no creator for {missing()} (version "
                         f"{PLUGIN_VERSION!r}, namespace {PLUGIN_NAMESPACE!r}); rebuild plugins/")


def parser_errors(parser) -> list[str]:
    """Every error of an OnnxParser (nvonnxparser::IParserError: code, desc, node index, node name and
    operator), one line each; plain str() where the binding lacks an accessor."""
    out = []
    for i in range(parser.num_errors):
        err = parser.get_error(i)
        try:
            where = f"node {err.node()}"
            name = getattr(err, "node_name", lambda: "")()
            op = getattr(err, "node_operator", lambda: "")()
            where += f" {name!r}" if name else ""
            where += f" ({op})" if op else ""
            out.append(f"{where}: {err.code()}: {err.desc()}")
        except AttributeError:
            out.append(str(err))
    return out


# -- one graph ---------------------------------------------------------------------------------------
def _build_plan(trt, logger, graph: str, onnx_path: Path, spec: EngineOptions, cache: bytes,
                hardware_compatible: bool) -> tuple[object, bytes, dict]:
    """Parse, profile and build one graph -> (serialized plan, timing cache bytes, profiles)."""
    logger.errors.clear()  # the errors of this graph only, for the messages below
    builder = trt.Builder(logger)
    flags = 0  # strongly typed: the flag in TensorRT 10; always on in 11 (kSTRONGLY_TYPED deprecated, ignored)
    if _major(trt) < 11 and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)  # owns the weights: keep it alive until the build ends
    # parseFromFile (not parse(bytes)): the path lets the parser resolve <graph>.onnx.data. The PEagle ops
    # are not ONNX operators, so the parser's plugin fallback finds their creators by op_type with no
    # OnnxParserFlag (kENABLE_PLUGIN_OVERRIDE is only for plugins named like ONNX operators).
    if not parser.parse_from_file(str(onnx_path)):
        errors = parser_errors(parser)
        for e in errors:
            log.error("ONNX parser: %s", e)
        raise BuildError(f"TensorRT could not parse {onnx_path}:\n  " + "\n  ".join(errors or logger.errors))
    shapes = {}
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        shapes[tensor.name] = [int(d) for d in tensor.shape]
    profiles = profiles_for(graph, spec, shapes)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(spec.workspace_gb * (1 << 30)))
    if aliased_plugin_io(trt):
        # present_* outputs alias the past_* inputs inside the IPluginV3OneBuildV2 attention plugin
        config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    if hardware_compatible:
        config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
    for name, entry in profiles.items():
        profile = builder.create_optimization_profile()
        for tensor, s in entry.items():
            if any(not _static(d) for d in shapes[tensor]):  # static inputs need no profile
                profile.set_shape(tensor, s["min"], s["opt"], s["max"])
        if config.add_optimization_profile(profile) < 0:
            raise BuildError(f"{graph}: TensorRT rejected the {name} profile {entry}")
    timing = config.create_timing_cache(cache)
    if not config.set_timing_cache(timing, False):
        log.warning("the timing cache does not match this GPU / TensorRT; starting an empty one")
        config.set_timing_cache(config.create_timing_cache(b""), False)
    log.info("building %s (%s profiles) ...", graph, len(profiles))
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BuildError(f"TensorRT could not build {graph} from {onnx_path}:\n  "
                         + "\n  ".join(logger.errors or ["(no error logged; rerun with -v)"]))
    return plan, bytes(memoryview(config.get_timing_cache().serialize())), profiles


def _major(trt) -> int:
    try:
        return int(str(trt.__version__).split(".")[0])
    except ValueError:
        return 0


def aliased_plugin_io(trt) -> bool:
    """Whether this TensorRT has the preview feature that lets plugin outputs alias inputs."""
    return hasattr(trt, "PreviewFeature") and hasattr(trt.PreviewFeature, "ALIASED_PLUGIN_IO_10_03")


def _write_atomic(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


# -- the stage ---------------------------------------------------------------------------------------
def _carry_over(out_dir: Path, tmp: Path, arch: str, export_hash: str) -> dict:
    """Copy the other architectures' plans of an existing engine directory; returns their entries."""
    if not out_dir.exists():
        return {}
    if not (out_dir / MANIFEST).is_file():
        raise BuildError(f"{out_dir} exists and is not an engine directory (no {MANIFEST}); remove it "
                         "or choose another --output")
    old = verify_manifest(out_dir)
    if old.get("export", {}).get("manifest_sha256") != export_hash:
        log.warning("%s was built from another export: dropping its plans", out_dir)
        return {}
    kept = {a: e for a, e in old.get("engines", {}).items() if a != arch}
    for entry in kept.values():
        files = [g["plan"] for g in entry["graphs"].values()]
        files += [entry["plugin_library"]["path"]] if entry.get("plugin_library") else []
        for rel in files:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(out_dir / rel, tmp / rel)
    return kept


def build_engines(export_dir: Path, out_dir: Path, spec: EngineOptions) -> dict:
    """Build every graph of `export_dir/trt/` for `spec.gpu_arch` into `out_dir`. Returns the manifest."""
    # An existing out_dir is updated (plans of other architectures kept) only when it is a previous
    # peagle-trt output; it never is, holds or lies inside an input. Checked before anything else.
    out_dir = check_output(out_dir, [export_dir, spec.plugin_library, spec.timing_cache_path()], force=True)
    trt = import_tensorrt()
    export_dir = Path(export_dir).absolute()
    export_manifest = verify_manifest(export_dir)
    graphs = {g: export_dir / "trt" / f"{g}.onnx" for g in GRAPHS}
    graphs = {g: p for g, p in graphs.items() if p.is_file()}
    if "target" not in graphs:
        raise BuildError(f"{export_dir / 'trt' / 'target.onnx'} not found; run the export stage first")
    gpu_name, visible = visible_gpu()
    check_arch(spec, visible)
    infos = {g: _graph_info(p) for g, p in graphs.items()}
    for g, info in infos.items():
        if info.get("num_spec_tokens") not in (None, spec.num_spec_tokens):
            raise BuildError(f"{g}.onnx was exported with K = {info['num_spec_tokens']} but "
                             f"--num-spec-tokens is {spec.num_spec_tokens}; pass the export's K")
    ops = sorted({op for info in infos.values() for op in info.get("plugin_ops", [])})
    if ops and spec.plugin_library is None:
        raise BuildError(f"the graphs use the plugins {ops}: pass --plugin-library (built from plugins/)")
    if spec.plugin_library is not None:
        load_plugins(trt, Path(spec.plugin_library), ops)  # before any parser sees a PEagle node
    export_hash = sha256(export_dir / MANIFEST)
    cache_path = spec.timing_cache_path()
    cache = cache_path.read_bytes() if cache_path.is_file() else b""
    logger = _make_logger(trt)
    with staged_dir(out_dir, "the engines") as tmp:
        engines = _carry_over(out_dir, tmp, spec.gpu_arch, export_hash)
        entry = {"gpu_name": gpu_name, "built_on": visible, "tensorrt_version": trt.__version__,
                 "cuda_version": cuda_version(), "strongly_typed": True,
                 "aliased_plugin_io": aliased_plugin_io(trt),
                 "hardware_compatibility": "AMPERE_PLUS" if spec.gpu_arch != visible else "NONE",
                 "spec": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(spec).items()},
                 # the paged cache the plans are built for; its element type is the export's
                 "kv": {**asdict(spec.kv_layout),
                        "cache_dtype": export_manifest.get("export", {}).get("kv", {}).get("cache_dtype", "auto")},
                 "timing_cache": str(cache_path), "plugin_library": None, "graphs": {}}
        if spec.plugin_library is not None:
            rel = Path("plugins") / spec.gpu_arch / Path(spec.plugin_library).name
            (tmp / rel).parent.mkdir(parents=True)
            shutil.copy2(spec.plugin_library, tmp / rel)
            entry["plugin_library"] = {"path": str(rel), "source": str(spec.plugin_library)}
        for graph, onnx_path in graphs.items():
            t0 = time.perf_counter()
            plan, cache, profiles = _build_plan(trt, logger, graph, onnx_path, spec, cache,
                                                spec.gpu_arch != visible)
            _write_atomic(cache_path, cache)  # persist after every graph: a later failure keeps it
            name = f"{graph}.{spec.gpu_arch}.plan"
            _write_atomic(tmp / name, plan)
            entry["graphs"][graph] = {"plan": name, "onnx": f"trt/{graph}.onnx", "profiles": profiles,
                                      "build_s": round(time.perf_counter() - t0, 1)}
        engines[spec.gpu_arch] = entry
        manifest = write_manifest(tmp, {
            "stage": "engine", "backend": "tensorrt", "gpu_arch": spec.gpu_arch, "gpu_name": gpu_name,
            "tensorrt_version": trt.__version__, "cuda_version": entry["cuda_version"],
            "export": {"dir": str(export_dir), "manifest_sha256": export_hash,
                       "peagle_trt_version": export_manifest.get("peagle_trt_version")},
            "engines": engines})
    return manifest

