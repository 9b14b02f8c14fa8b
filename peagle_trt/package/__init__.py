"""Stage package: render a ready Triton model repository from `model_repo/` templates.

    peagle-trt build --target DIR --drafter DIR --output REPO [--num-spec-tokens K]
                     [--backend onnxruntime|torch]

Backends: `torch` copies the checkpoints and serves them with the reference torch executor;
`onnxruntime` exports the ONNX graphs (docs/EXPORT.md) and serves them with onnxruntime;
`tensorrt` also builds TensorRT plans from them (needs TensorRT and a GPU: NGC containers).

The repository is written into a temporary sibling directory and renamed into place at the end,
so a failed build (bad drafter, unwritable output, interrupted copy) leaves nothing behind.
`--force` replaces only a previous peagle-trt output, never an input (peagle_trt/atomic.py); a
pickled checkpoint is refused before any weight is read, quantization included.
`manifest.json` in the model directory hashes every artifact; the model verifies it at load.
"""

from __future__ import annotations

import logging
import shutil
import string
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from peagle_trt.checkpoint import load_pair
from peagle_trt.atomic import check_output, staged_dir
from peagle_trt.checkpoint.drafter import check_window
from peagle_trt.checkpoint.safetensors_io import require_safetensors
from peagle_trt.config import SpecConfig
from peagle_trt.errors import BuildError
from peagle_trt.manifest import write_manifest
from peagle_trt.runtime.executor import KERNELS

log = logging.getLogger(__name__)
BACKENDS = ("torch", "onnxruntime", "tensorrt")
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "vocab.json",
                    "merges.txt")


@dataclass(frozen=True)
class RepoSpec:
    spec: SpecConfig
    model_name: str = "peagle"
    backend: str = "torch"
    max_batch: int = 8
    max_seq_len: int = 2048
    prefill_chunk: int = 256
    device: str = "cpu"
    dtype: str = "float32"
    gpu_arch: str = "sm_90"  # tensorrt backend: sm_90 (H100/H200) | sm_100 (B200)
    plugin_library: str | None = None  # tensorrt backend: libpeagle plugins (.so)
    kernels: str = "reference"  # torch backend: custom ops in torch | on the CUDA kernels ("cuda")
    max_prompt_bytes: int | None = None  # None: serving.protocol's default (16 x max_seq_len)
    max_stop_bytes: int | None = None  # None: serving.protocol's default (1024, all stop strings)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise BuildError(f"backend {self.backend!r} is not available yet; choose from {BACKENDS}")
        if self.kernels not in KERNELS:
            raise BuildError(f"kernels {self.kernels!r} is not one of {KERNELS}")
        if self.kernels == "cuda" and (self.backend != "torch" or not self.device.startswith("cuda")):
            raise BuildError(f"kernels='cuda' runs the torch backend's custom ops on the CUDA kernels: it needs "
                             f"--backend torch --device cuda (got backend {self.backend!r}, device "
                             f"{self.device!r}); the tensorrt backend always uses them (as plugins)")
        if self.max_batch < 1 or self.max_seq_len < 2 or self.prefill_chunk < 1:
            raise BuildError("max_batch, max_seq_len and prefill_chunk must be positive")
        if (self.max_prompt_bytes is not None and self.max_prompt_bytes < 1) or \
                (self.max_stop_bytes is not None and self.max_stop_bytes < 0):
            raise BuildError(f"max_prompt_bytes must be >= 1 and max_stop_bytes >= 0, got "
                             f"{self.max_prompt_bytes}, {self.max_stop_bytes}")

    def input_limits(self) -> dict[str, int]:
        """The byte limits the served model enforces (config.pbtxt parameters)."""
        from peagle_trt.serving.protocol import MAX_STOP_BYTES, PROMPT_BYTES_PER_TOKEN

        return {"max_prompt_bytes": self.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * self.max_seq_len,
                "max_stop_bytes": MAX_STOP_BYTES if self.max_stop_bytes is None else self.max_stop_bytes}

    @property
    def max_rows(self) -> int:
        """Most rows of one request in a target forward: a prefill chunk or a verify window."""
        return max(self.prefill_chunk, self.spec.k + 1)


def templates_dir() -> Path:
    here = Path(__file__).resolve().parents[2] / "model_repo"
    if not (here / "peagle" / "config.pbtxt.tmpl").is_file():
        raise BuildError(f"Triton templates not found at {here}; install peagle-trt from a source "
                         "checkout (pip install -e .) so model_repo/ is available")
    return here


def _copy_checkpoint(src: Path, dst: Path, weights: bool = True) -> None:
    dst.mkdir(parents=True)
    for p in sorted(src.iterdir()):
        is_weight = p.suffix == ".safetensors" or p.name.endswith(".safetensors.index.json")
        if p.name in CHECKPOINT_FILES or p.name == "hf_quant_config.json" or (weights and is_weight):
            shutil.copy2(p, dst / p.name)


def _write_artifacts(pair, target: Path, drafter: Path | None, version: Path, repo: "RepoSpec") -> dict:
    """Copy or generate the backend's artifacts under version/artifacts; returns config paths."""
    artifacts = version / "artifacts"
    if repo.backend == "torch":
        log.info("copying target checkpoint %s", target)
        _copy_checkpoint(Path(target), artifacts / "target")
        if pair.drafter is not None:
            log.info("copying drafter checkpoint %s", drafter)
            _copy_checkpoint(Path(drafter), artifacts / "drafter")
        return {"target_path": "artifacts/target",
                "drafter_path": "artifacts/drafter" if pair.drafter is not None else "", "onnx_path": ""}
    from peagle_trt.export import ExportSpec, export_models

    _copy_checkpoint(Path(target), artifacts / "tokenizer", weights=False)
    target_model, drafter_model = pair.build()
    log.info("exporting ONNX graphs")
    dtype = "float32" if repo.backend == "onnxruntime" else "float16"
    # windowed KV rings need the attention extensions the TensorRT plugins do not have yet
    max_rows = repo.max_rows if repo.backend == "onnxruntime" else None
    export_models(target_model, drafter_model, artifacts / "onnx",
                  ExportSpec(repo.spec, repo.max_batch, repo.max_seq_len, dtype, max_rows))
    paths = {"target_path": "artifacts/tokenizer", "drafter_path": "", "onnx_path": "artifacts/onnx"}
    if repo.backend == "tensorrt":
        from peagle_trt.engine import EngineSpec, build_engines

        build_engines(artifacts / "onnx", artifacts / "engines",
                      EngineSpec(repo.gpu_arch, repo.max_batch, repo.max_seq_len, repo.spec.k, repo.prefill_chunk,
                                 Path(repo.plugin_library) if repo.plugin_library else None))
        paths["engine_path"] = "artifacts/engines"
    return paths


def build_repository(target: Path, drafter: Path | None, output: Path, repo: RepoSpec,
                     force: bool = False, quant=None) -> dict:
    """Validate the pair, then write the repository atomically. Returns the manifest.
    `quant` (a `quantize.QuantSpec`): quantize the target to FP8 first (ModelOpt)."""
    inputs = [target, drafter, repo.plugin_library, quant.calib_data if quant is not None else None]
    output = check_output(output, inputs, force)  # before any work: never over an input or a foreign dir
    if quant is not None:
        import tempfile

        from peagle_trt.quantize import quantize_target

        for model_dir in (target, drafter):  # refuse pickles before the (long) quantization reads anything
            if model_dir is not None:
                require_safetensors(Path(model_dir))

        with tempfile.TemporaryDirectory(prefix=".peagle-fp8-", dir=output.parent if output.parent.exists()
                                         else None) as tmp:
            quantize_target(target, Path(tmp) / "target-fp8", quant)
            return build_repository(Path(tmp) / "target-fp8", drafter, output, repo, force)
    pair = load_pair(target, drafter, repo.spec)  # raises before anything is written
    memory = slot_memory(pair, repo)
    print(memory.describe(repo.max_batch), file=sys.stderr, flush=True)
    if repo.backend == "tensorrt":
        from peagle_trt.engine import import_tensorrt

        if pair.drafter is not None and repo.spec.mode != "none":  # the plugins have no windows: exact only inside the drafter's W
            check_window(pair.drafter.config, repo.max_seq_len + repo.spec.k + 1, repo.backend)

        import_tensorrt()  # fail fast, with the NGC container to use, before any export work
    templates = templates_dir()
    with staged_dir(output, "the repository") as tmp:
        model_dir = tmp / repo.model_name
        version = model_dir / "1"
        version.mkdir(parents=True)
        shutil.copy2(templates / "peagle" / "1" / "model.py", version / "model.py")
        paths = _write_artifacts(pair, target, drafter, version, repo)
        values = {**asdict(repo), "spec_mode": repo.spec.mode, "num_spec_tokens": repo.spec.num_spec_tokens,
                  "instance_kind": "GPU" if repo.device.startswith("cuda") or repo.backend == "tensorrt" else "CPU",
                  "engine_path": "", **repo.input_limits(), **paths}
        config = string.Template((templates / "peagle" / "config.pbtxt.tmpl").read_text()).substitute(values)
        (model_dir / "config.pbtxt").write_text(config)
        manifest = write_manifest(model_dir, {
            "repo": {k: v for k, v in values.items() if k != "spec"},
            "target": {"source": str(target), "arch": pair.target.config.arch},
            "drafter": ({"source": str(drafter), "layout": pair.drafter.config.layout}
                        if pair.drafter is not None else None),
            "taps": list(pair.taps), "kv_memory": memory.as_dict()})
    return manifest


def slot_memory(pair, repo: RepoSpec):
    """KV bytes per slot this build's executor allocates (models/memory.py); windowed layers hold
    only their window on the torch and onnxruntime backends."""
    from peagle_trt.models.memory import kv_slot_memory

    dtype_bytes = 4 if repo.backend != "tensorrt" and repo.dtype == "float32" else 2
    max_rows = repo.max_rows if repo.backend != "tensorrt" else None
    max_len = repo.max_seq_len + repo.spec.k + 1  # as the runtime allocates
    drafter = pair.drafter.config if pair.drafter is not None else None
    return kv_slot_memory(pair.target.config, drafter, max_len, max_rows, dtype_bytes)
