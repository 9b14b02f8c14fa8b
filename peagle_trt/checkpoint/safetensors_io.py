"""Read model weights from safetensors files only: one `model.safetensors` or a sharded index.

Pickled checkpoints (`*.bin`, `*.pt`) are refused, never unpickled: a checkpoint is data, not code.
Every failure (missing shard, truncated or corrupt file, index naming a tensor its shard lacks)
becomes a `CheckpointError` naming the file and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from peagle_trt.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
NO_PICKLE = ("peagle-trt never unpickles checkpoints (a pickle can run code); convert them to safetensors, "
             "e.g. model.save_pretrained(DIR, safe_serialization=True), in an environment you trust.")


def weight_files(model_dir: Path) -> dict[Path, list[str] | None]:
    """Map each safetensors file of `model_dir` to the tensor names the index assigns it (None: all)."""
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: no such checkpoint directory")
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc}); "
                                  "expected a JSON object with a 'weight_map'") from exc
        files: dict[Path, list[str]] = {}
        for name, shard in weight_map.items():
            files.setdefault(model_dir / shard, []).append(name)
        pickled = sorted({p.name for p in files if not p.name.endswith(".safetensors")})
        if pickled:
            raise CheckpointError(f"{index}: maps tensors to {pickled[:3]}, which are not safetensors files; "
                                  f"{NO_PICKLE}")
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return {model_dir / SINGLE_FILE: None}
    found = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if len(found) == 1:
        return {model_dir / found[0]: None}
    if found:
        raise CheckpointError(f"{model_dir}: found {len(found)} safetensors shards but no {INDEX_FILE}; "
                              "restore the index file that maps tensors to shards")
    pickled = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    hint = f" Found pickled weights {pickled}: {NO_PICKLE}" if pickled else ""
    raise CheckpointError(f"{model_dir}: no weights found; expected {SINGLE_FILE} or {INDEX_FILE}.{hint}")


def require_safetensors(model_dir: Path) -> None:
    """CheckpointError unless `model_dir` holds safetensors weights; reads file names, never weights.
    Stages that load weights with another library (ModelOpt calibration through transformers) call
    this first, so a pickled checkpoint is refused before anything opens it."""
    if not Path(model_dir).is_dir():
        raise CheckpointError(f"{model_dir}: not a directory; pass a Hugging Face model directory")
    weight_files(Path(model_dir))


def load_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, by name, on the CPU in their stored dtype."""
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, torch.Tensor] = {}
    for path, expected in weight_files(model_dir).items():
        if not path.is_file():
            raise CheckpointError(f"{path}: weight file listed in {INDEX_FILE} is missing; "
                                  "re-download the checkpoint")
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
                missing = sorted(set(expected or []) - set(names))
                if missing:
                    raise CheckpointError(f"{path}: the index assigns {missing[:3]} to this file but it "
                                          "does not hold them; the shard or the index is stale")
                for name in names:
                    tensors[name] = f.get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({exc}); "
                                  "re-download or re-export it") from exc
        except (OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: cannot read weights ({exc}); the file is truncated or "
                                  "corrupt; re-download or re-export it") from exc
    return tensors


def read_config(model_dir: Path) -> dict:
    """The parsed `config.json` of a model directory."""
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory; pass a Hugging Face model directory")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; a model directory needs its config.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def tensor_names(model_dir: Path) -> set[str]:
    """Names of the tensors of a checkpoint, read from headers only (no tensor data)."""
    from safetensors import SafetensorError, safe_open

    names: set[str] = set()
    for path, expected in weight_files(model_dir).items():
        if expected is not None:
            names.update(expected)
            continue
        try:
            with safe_open(str(path), framework="pt") as f:
                names.update(f.keys())
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({exc})") from exc
    return names
