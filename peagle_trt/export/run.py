"""Stage `export`: the target and drafter as ONNX graphs with `peagle` plugin nodes.

    peagle-trt export --target DIR --drafter DIR --output DIR [--num-spec-tokens K] ...

Writes target.onnx, drafter.onnx (one parallel pass), drafter_step.onnx + drafter_fc.onnx
(sequential EAGLE-3 drafting), each with external data, a TensorRT copy of each without the
model-local functions under trt/, and manifest.json. Atomic: a failed export leaves nothing.
Contract: docs/EXPORT.md.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx

from peagle_trt.atomic import check_output, staged_dir
from peagle_trt.config import BLOCK_SIZE, KV_CACHE_DTYPES, PREFILL_CHUNK, KVLayout, SpecConfig
from peagle_trt.errors import ConfigError
from peagle_trt.manifest import write_manifest


@dataclass(frozen=True)
class ExportOptions:
    speculation: SpecConfig
    max_batch: int = 8  # most requests per step
    max_seq_len: int = 2048
    dtype: str = "float32"
    max_rows: int | None = None  # most rows of a request per target run (None: max(prefill chunk, K + 1))
    kv_blocks: int = 0  # KV blocks of the full-attention layers and the drafter; 0: max_batch full requests
    block_size: int = BLOCK_SIZE
    kv_cache_dtype: str = "auto"  # auto: the export dtype; fp8: E4M3 codes (config.KV_CACHE_DTYPES)

    def __post_init__(self):
        if self.dtype not in ("float32", "float16"):
            raise ConfigError(f"export dtype {self.dtype!r} is not supported (float32 | float16)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")

    @property
    def max_len(self) -> int:
        """KV positions per request: the sequence plus a verify window (as the runtime allocates)."""
        return self.max_seq_len + self.speculation.max_nodes + 1

    @property
    def kv(self) -> KVLayout:
        """The paged cache the graphs' KV inputs are shaped for (the same rule as
        RepositoryOptions.kv_layout)."""
        rows = self.max_rows or max(PREFILL_CHUNK, self.speculation.max_nodes + 1)
        if not self.kv_blocks:
            return KVLayout.for_sequences(self.max_batch, self.max_len, self.block_size, max_rows=rows,
                                          cache_dtype=self.kv_cache_dtype)
        return KVLayout(self.kv_blocks, self.max_len, self.max_batch, self.block_size, rows, self.kv_cache_dtype)


def _described(spec: ExportOptions) -> dict:
    """The manifest's "export" entry (its keys predate the field's name `speculation`)."""
    described = asdict(spec)
    return {"spec": described.pop("speculation"), **described}


def save(model: onnx.ModelProto, path: Path) -> None:
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)


def export_models(target, drafter, out_dir: Path, spec: ExportOptions, info: dict | None = None,
                  force: bool = False) -> dict:
    """Export built torch models (TargetModel, DrafterModel | None) into `out_dir` atomically.
    `force` replaces a previous peagle-trt output there (peagle_trt/atomic.py), nothing else."""
    from peagle_trt.export.graphs import export_drafter, export_drafter_fc, export_drafter_step, export_target
    from peagle_trt.ops.onnx_defs import register_schemas, strip_functions

    register_schemas()
    out_dir = check_output(out_dir, (), force)
    timings = {}
    with staged_dir(out_dir, "the export") as tmp:
        (tmp / "trt").mkdir(parents=True)
        kv = spec.kv
        graphs = {"target": lambda: export_target(target, kv, spec.dtype)}
        if drafter is not None:
            if spec.speculation.mode == "peagle":
                graphs["drafter"] = lambda: export_drafter(drafter, kv, spec.speculation.num_spec_tokens, spec.dtype)
            graphs["drafter_step"] = lambda: export_drafter_step(drafter, kv, spec.dtype)
            graphs["drafter_fc"] = lambda: export_drafter_fc(drafter, spec.dtype)
        if drafter is not None:  # d2t for the sequential path (plain .npy: no pickle)
            np.save(tmp / "d2t.npy", drafter.d2t.cpu().numpy().astype(np.int64), allow_pickle=False)
        for name, make in graphs.items():
            t0 = time.perf_counter()
            model = make()
            trt_copy = strip_functions(model)  # before saving: saving moves tensor data out of the proto
            save(model, tmp / f"{name}.onnx")
            save(trt_copy, tmp / "trt" / f"{name}.onnx")
            timings[name] = round(time.perf_counter() - t0, 3)
        manifest = write_manifest(tmp, {"export": {**_described(spec), "max_len": spec.max_len,
                                                   "kv": asdict(kv), "windows": list(target.kv_windows)},
                                        "graphs": sorted(graphs), "export_s": timings, **(info or {})})
    return manifest


def export_pair(target_dir: Path, drafter_dir: Path | None, out_dir: Path, spec: ExportOptions,
                force: bool = False) -> dict:
    """Load a checkpoint pair (FP8 targets included) and export it."""
    from peagle_trt.checkpoint import load_pair

    check_output(out_dir, [target_dir, drafter_dir], force)  # before loading anything
    pair = load_pair(target_dir, drafter_dir, spec.speculation)
    target, drafter = pair.build()
    return export_models(target, drafter, out_dir, spec,
                         {"target": str(target_dir), "drafter": str(drafter_dir) if drafter_dir else None,
                          "taps": list(pair.taps)}, force)
