"""Stage `build`: render a ready Triton model repository from the `model_repo/` templates.

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
from dataclasses import fields
from importlib import resources
from pathlib import Path

from peagle_trt.atomic import check_output, staged_dir
from peagle_trt.checkpoint import load_pair
from peagle_trt.checkpoint.drafter import check_window
from peagle_trt.checkpoint.safetensors_io import require_safetensors
from peagle_trt.errors import BuildError
from peagle_trt.manifest import write_manifest
from peagle_trt.serve.options import ArtifactPaths, RepositoryOptions, to_parameters

log = logging.getLogger(__name__)
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "vocab.json",
                    "merges.txt")


def templates_dir() -> Path:
    """model_repo/ of the installed package (`peagle_trt.model_repo`, shipped in the wheel)."""
    try:
        here = Path(str(resources.files("peagle_trt.model_repo")))
    except ModuleNotFoundError:  # an editable install made before model_repo/ became a package
        here = Path("peagle_trt.model_repo (not installed)")
    if not (here / "peagle" / "config.pbtxt.tmpl").is_file():
        raise BuildError(f"Triton templates not found at {here}: this peagle-trt installation is incomplete "
                         "(model_repo/ ships in the wheel as peagle_trt.model_repo); reinstall peagle-trt "
                         "(pip install ., or pip install -e . for a checkout)")
    return here


def render_parameters(params: dict[str, str]) -> str:
    """config.pbtxt `parameters` lines (string values, as Triton's Python backend reads them)."""
    for key, value in params.items():
        if '"' in value or "\\" in value or "\n" in value:
            raise BuildError(f"parameter {key}={value!r} cannot be written into config.pbtxt (quote, backslash "
                             "or newline); use a path without them")
    return "\n".join(f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}' for k, v in params.items())


def _copy_checkpoint(src: Path, dst: Path, weights: bool = True) -> None:
    dst.mkdir(parents=True)
    for p in sorted(src.iterdir()):
        is_weight = p.suffix == ".safetensors" or p.name.endswith(".safetensors.index.json")
        if p.name in CHECKPOINT_FILES or p.name == "hf_quant_config.json" or (weights and is_weight):
            shutil.copy2(p, dst / p.name)


def _write_artifacts(pair, target: Path, drafter: Path | None, version: Path,
                     repo: RepositoryOptions) -> ArtifactPaths:
    """Copy or generate the backend's artifacts under version/artifacts; returns their paths."""
    artifacts = version / "artifacts"
    if repo.backend == "torch":
        log.info("copying target checkpoint %s", target)
        _copy_checkpoint(Path(target), artifacts / "target")
        if pair.drafter is not None:
            log.info("copying drafter checkpoint %s", drafter)
            _copy_checkpoint(Path(drafter), artifacts / "drafter")
        return ArtifactPaths("artifacts/target", "artifacts/drafter" if pair.drafter is not None else "")
    from peagle_trt.export import ExportOptions, export_models

    _copy_checkpoint(Path(target), artifacts / "tokenizer", weights=False)
    target_model, drafter_model = pair.build()
    log.info("exporting ONNX graphs")
    dtype = "float32" if repo.backend == "onnxruntime" else "float16"
    export_models(target_model, drafter_model, artifacts / "onnx",
                  ExportOptions(repo.speculation, repo.max_batch, repo.max_seq_len, dtype, repo.max_rows,
                                repo.kv_blocks, repo.block_size, repo.kv_cache_dtype))
    if repo.backend != "tensorrt":
        return ArtifactPaths("artifacts/tokenizer", onnx="artifacts/onnx")
    from peagle_trt.engine import EngineOptions, build_engines

    plugins = Path(repo.plugin_library) if repo.plugin_library else None
    build_engines(artifacts / "onnx", artifacts / "engines",
                  EngineOptions(repo.gpu_arch, repo.max_batch, repo.max_seq_len, repo.speculation.num_spec_tokens,
                                repo.prefill_chunk, plugins, block_size=repo.block_size, kv_blocks=repo.kv_blocks,
                                max_nodes=repo.speculation.max_nodes, tree_width=repo.speculation.tree_width))
    return ArtifactPaths("artifacts/tokenizer", onnx="artifacts/onnx", engine="artifacts/engines")


def build_repository(target: Path, drafter: Path | None, output: Path, repo: RepositoryOptions,
                     force: bool = False, quant=None) -> dict:
    """Validate the pair, then write the repository atomically. Returns the manifest.
    `quant` (a `quantize.QuantizeOptions`): quantize the target to FP8 first (ModelOpt)."""
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
    pair = load_pair(target, drafter, repo.speculation)  # raises before anything is written
    memory = kv_memory_of(pair, repo)
    print(memory.describe(), file=sys.stderr, flush=True)
    if repo.backend == "tensorrt":
        from peagle_trt.engine import import_tensorrt

        # the plugins have no windows: exact only inside the drafter's W
        if pair.drafter is not None and repo.speculation.mode != "none":
            check_window(pair.drafter.config, repo.max_seq_len + repo.speculation.num_spec_tokens + 1, repo.backend)

        import_tensorrt()  # fail fast, with the NGC container to use, before any export work
    templates = templates_dir()
    with staged_dir(output, "the repository") as tmp:
        model_dir = tmp / repo.model_name
        version = model_dir / "1"
        version.mkdir(parents=True)
        shutil.copy2(templates / "peagle" / "1" / "model.py", version / "model.py")
        paths = _write_artifacts(pair, target, drafter, version, repo)
        instance_kind = "GPU" if repo.device.startswith("cuda") or repo.backend == "tensorrt" else "CPU"
        params = to_parameters(repo, paths)
        config = string.Template((templates / "peagle" / "config.pbtxt.tmpl").read_text()).substitute(
            model_name=repo.model_name, instance_kind=instance_kind, parameters=render_parameters(params))
        (model_dir / "config.pbtxt").write_text(config)
        typed = {f.name: getattr(repo, f.name) for f in fields(repo) if f.name != "speculation"}
        manifest = write_manifest(model_dir, {
            "repo": {**typed, "spec_mode": repo.speculation.mode,
                     "num_spec_tokens": repo.speculation.num_spec_tokens, "instance_kind": instance_kind,
                     **repo.input_limits(), **{k: v for k, v in params.items() if k.endswith("_path")}},
            "target": {"source": str(target), "arch": pair.target.config.arch},
            "drafter": ({"source": str(drafter), "layout": pair.drafter.config.layout}
                        if pair.drafter is not None else None),
            "taps": list(pair.taps), "kv_memory": memory.as_dict()})
    return manifest


def kv_memory_of(pair, repo: RepositoryOptions):
    """KV bytes this build's executor allocates (peagle_trt/models/memory.py), for `repo.kv_layout`."""
    from peagle_trt.models.memory import kv_memory

    dtype_bytes = 4 if repo.backend != "tensorrt" and repo.dtype == "float32" else 2  # an FP8 cache: 1 (kv_memory)
    drafter = pair.drafter.config if pair.drafter is not None else None
    return kv_memory(pair.target.config, drafter, repo.kv_layout, dtype_bytes)
