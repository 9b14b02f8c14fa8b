"""Stage quantize: FP8 (E4M3) post-training quantization of the target with NVIDIA ModelOpt.

    peagle-trt quantize --target DIR --output DIR [--kv-cache-fp8] [--calib-data FILE.jsonl]

    manifest = quantize_target(target_dir, out_dir, QuantizeOptions(kv_cache_fp8=False))

The Hugging Face target is loaded with transformers (float32, local files only, no remote code),
ModelOpt inserts per-tensor FP8 quantizers into every linear layer (`FP8_DEFAULT_CFG`, plus
`FP8_KV_CFG` with `kv_cache_fp8`) and max-calibrates them on a few prompts (built in, or a JSONL
file: see calib.py). lm_head, the embeddings and MoE routers stay unquantized. ModelOpt's
`export_hf_checkpoint` writes the unified HF checkpoint: float8_e4m3fn weights with fp32
`weight_scale` / `input_scale` (and `k_scale` / `v_scale` with the KV config), `hf_quant_config.json`
and `quantization_config` in config.json. The tokenizer files are copied and `manifest.json` is
written last. Everything goes into a temporary sibling directory that is renamed into place at
the end: a failed run leaves nothing behind.

Our loader (peagle_trt/models/fp8.py) reads the result into a `TargetModel` with `FP8Linear`
layers that reproduce ModelOpt's fake-quantized forward; the output is checked to load that way
before it is renamed into place. The drafter stays unquantized (FP8 drafts lower acceptance).
"""

from __future__ import annotations

import contextlib
import copy
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from peagle_trt.atomic import check_output, staged_dir
from peagle_trt.errors import BuildError, ConfigError
from peagle_trt.manifest import write_manifest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json")
# Quantizers disabled on top of ModelOpt's defaults (which already skip most of them): the logits
# head, the embeddings and MoE routers / gates stay in the model dtype.
EXCLUDE = ("*lm_head*", "*embed_tokens*", "*router*", "*mlp.gate.*", "*block_sparse_moe.gate*",
           "*shared_expert_gate*")

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class QuantizeOptions:
    kv_cache_fp8: bool = False  # also quantize the KV cache (k_scale / v_scale)
    calib_data: Path | None = None  # JSONL ("prompt" or "text" per line); None: built-in prompts
    num_calib: int = 64  # calibration samples (at most; the built-in set holds 16)
    max_calib_len: int = 512  # tokens per sample (longer samples are truncated)
    device: str = "cpu"  # where calibration runs ("cuda" on a GPU machine)
    quantize_drafter: bool = False  # not supported: the drafter stays unquantized

    def __post_init__(self):
        if self.num_calib < 1:
            raise ConfigError(f"num_calib must be >= 1, got {self.num_calib}")
        if self.max_calib_len < 1:
            raise ConfigError(f"max_calib_len must be >= 1, got {self.max_calib_len}")
        if self.quantize_drafter:
            raise ConfigError("drafter quantization is not supported: FP8 drafts lower acceptance "
                              "and the drafter is small; quantize the target only and serve the "
                              "drafter unquantized")


def stderr_progress(done: int, total: int) -> None:
    end = "\n" if done == total else ""
    print(f"\rcalibrating {done}/{total}", end=end, file=sys.stderr, flush=True)


def _modelopt():
    """(mtq, export_hf_checkpoint, version), imported lazily with a clear error when missing."""
    try:
        with warnings.catch_warnings():  # "transformers X is not tested with current modelopt"
            warnings.filterwarnings("ignore", message=r".*transformers .* is not tested.*")
            import modelopt
            import modelopt.torch.quantization as mtq
            from modelopt.torch.export import export_hf_checkpoint
    except ImportError as exc:
        raise BuildError(f"nvidia-modelopt is needed for `quantize` but cannot be imported ({exc}); "
                         "install it with `pip install nvidia-modelopt requests` (without the [hf] "
                         "extra, which pins an older transformers)") from exc
    return mtq, export_hf_checkpoint, getattr(modelopt, "__version__", "unknown")


def quant_config(mtq, kv_cache_fp8: bool) -> dict:
    """ModelOpt's FP8_DEFAULT_CFG (+ FP8_KV_CFG) with EXCLUDE disabled, as a fresh dict.

    ModelOpt 0.4x writes `quant_cfg` as an ordered list of {"quantizer_name": pattern, ...} rules
    (later rules win): configs combine by concatenation. Older releases use a {pattern: attrs}
    dict: those merge by update."""
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    rules = cfg["quant_cfg"]
    if isinstance(rules, list):
        if kv_cache_fp8:
            rules += copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
        rules += [{"quantizer_name": pattern, "enable": False} for pattern in EXCLUDE]
    else:
        if kv_cache_fp8:
            rules.update(copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"]))
        rules.update({pattern: {"enable": False} for pattern in EXCLUDE})
    return cfg


def check_target(target_dir: Path):
    """The target's TargetConfig; ConfigError unless it is an unquantized model we can serve."""
    from peagle_trt.checkpoint.safetensors_io import require_safetensors
    from peagle_trt.checkpoint.target import load_target_config

    if not (target_dir / "config.json").is_file():
        raise ConfigError(f"target {target_dir}: no config.json; pass a Hugging Face model directory")
    config = load_target_config(target_dir)
    require_safetensors(target_dir)  # names only: a pickled checkpoint is refused before it is read
    if config.quantization is not None:
        raise ConfigError(f"target {target_dir} is already quantized ({config.quantization}); "
                          "quantize the unquantized checkpoint")
    return config


def calibrate(target_dir: str | Path, spec: QuantizeOptions, progress: Progress | None = stderr_progress):
    """Load the HF target and run ModelOpt FP8 PTQ on it. Returns (fake-quantized HF model, info).

    The model computes ModelOpt's fake-quantized forward (what the exported checkpoint encodes)."""
    import torch

    from peagle_trt.quantize.calib import calibration_samples, tokenize_samples
    from peagle_trt.tokenizer import TextCodec

    target_dir = Path(target_dir)
    check_target(target_dir)
    samples, source = calibration_samples(spec.calib_data, spec.num_calib)
    batches = tokenize_samples(TextCodec(target_dir), samples, spec.max_calib_len)
    mtq, _, version = _modelopt()
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, local_files_only=True,
                                                     trust_remote_code=False, use_safetensors=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"target {target_dir}: transformers cannot load it ({exc})") from exc
    model = model.to(spec.device).eval()

    def forward_loop(m):
        with torch.no_grad():
            for i, ids in enumerate(batches, 1):
                m(input_ids=torch.tensor([ids], device=spec.device), use_cache=False)
                if progress is not None:
                    progress(i, len(batches))

    with contextlib.redirect_stdout(sys.stderr):  # keep the CLI's stdout for its JSON line
        model = mtq.quantize(model, quant_config(mtq, spec.kv_cache_fp8), forward_loop)
    info = {"source": source, "samples": len(batches), "tokens": sum(map(len, batches)),
            "max_len": spec.max_calib_len, "modelopt_version": version}
    return model, info


def export_checkpoint(model, export_dir: Path) -> None:
    """ModelOpt's unified HF export (FP8 weights + scales, hf_quant_config.json, config.json)."""
    _, export_hf_checkpoint, _ = _modelopt()
    with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="To copy construct from a tensor")  # modelopt-internal
        export_hf_checkpoint(model, export_dir=export_dir)


def verify_fp8_checkpoint(path: Path) -> list[str]:
    """Load `path` with our own loader; returns the FP8 layer names (CheckpointError if unloadable)."""
    from peagle_trt.checkpoint.target import load_target
    from peagle_trt.models.fp8 import fp8_layers
    from peagle_trt.models.target import TargetModel

    ckpt = load_target(path)
    model = TargetModel.from_tensors(ckpt.config, ckpt.tensors, (), name=f"quantized target {path}")
    layers = sorted(fp8_layers(model))
    if ckpt.config.quantization != "fp8" or not layers:
        raise BuildError(f"{path}: the export holds no FP8 layers (quantization="
                         f"{ckpt.config.quantization!r}); nothing was quantized")
    return layers


def quantize_target(target_dir: str | Path, out_dir: str | Path, spec: QuantizeOptions = QuantizeOptions(),
                    force: bool = False, progress: Progress | None = stderr_progress) -> dict:
    """FP8-quantize the HF target in `target_dir` into `out_dir` (atomically). Returns the manifest."""
    t0 = time.perf_counter()
    target_dir, output = Path(target_dir), Path(out_dir).absolute()
    if output.resolve() == target_dir.resolve():
        raise ConfigError(f"--output {output} is the target directory itself; choose another directory")
    output = check_output(output, [target_dir, spec.calib_data], force)
    model, calib = calibrate(target_dir, spec, progress)  # all input errors raise before any write
    calib_s = time.perf_counter() - t0
    with staged_dir(output, "the quantized checkpoint") as tmp:
        export_checkpoint(model, tmp)
        del model
        for name in TOKENIZER_FILES:
            if (target_dir / name).is_file() and not (tmp / name).exists():
                shutil.copy2(target_dir / name, tmp / name)
        layers = verify_fp8_checkpoint(tmp)
        manifest = write_manifest(tmp, {
            "stage": "quantize",
            "source": str(target_dir),
            "quantization": {"weights": "fp8_e4m3", "activations": "fp8_e4m3", "granularity": "per-tensor",
                             "kv_cache": "fp8_e4m3" if spec.kv_cache_fp8 else None,
                             "excluded": list(EXCLUDE), "fp8_layers": len(layers),
                             "tool": f"nvidia-modelopt {calib.pop('modelopt_version')}"},
            "calibration": calib,
            "timings": {"calibrate_s": round(calib_s, 3), "total_s": round(time.perf_counter() - t0, 3)},
        })
    return manifest
