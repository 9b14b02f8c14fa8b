"""Bad checkpoints and bad configs fail early, with the specific error type and an actionable message.

One test per bad input. The session fixture `tiny` is never touched: every test copies the
directory it breaks into `tmp_path` first (`broken_copy`), then edits the copy's config.json
(`edit_config`) or its tensors (`rewrite_tensors`).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from peagle_trt.checkpoint import load_drafter, load_pair, load_target
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import CheckpointError, ConfigError, PairingError
from peagle_trt.make_tiny import make_target

WEIGHTS = "model.safetensors"


# --------------------------------------------------------------------------- helpers


def broken_copy(src: Path, tmp_path: Path, name: str | None = None) -> Path:
    """A private copy of a fixture checkpoint directory, safe to break."""
    dst = tmp_path / (name or src.name)
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: Path, remove: tuple[str, ...] = (), **changes) -> Path:
    """Rewrite `model_dir/config.json`: drop the keys in `remove`, then set `changes`."""
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    for key in remove:
        del cfg[key]
    cfg.update(changes)
    path.write_text(json.dumps(cfg, indent=2))
    return model_dir


def rewrite_tensors(model_dir: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Load `model_dir/model.safetensors`, let `edit` change the dict in place, save it back."""
    path = model_dir / WEIGHTS
    tensors = load_file(str(path))
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return model_dir


def peagle(k: int = 3) -> SpecConfig:
    return SpecConfig("peagle", k)


def fingerprint(dirs) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file under `dirs`, to prove a test left them alone."""
    return {str(f): (f.stat().st_size, f.stat().st_mtime_ns)
            for d in dirs for f in sorted(Path(d).rglob("*")) if f.is_file()}


@pytest.fixture(autouse=True)
def _fixture_dirs_untouched(tiny):
    before = fingerprint(tiny.values())
    yield
    assert fingerprint(tiny.values()) == before, "a test modified the shared `tiny` checkpoints"


# --------------------------------------------------------------------------- pairing


def test_hidden_size_mismatch(tiny, tmp_path):
    # A drafter trained for a target of hidden 32: fc reads 3 x 32 = 96 features, mask_hidden too.
    drafter = edit_config(broken_copy(tiny["aws"], tmp_path), target_hidden_size=32)

    def narrow(t):
        t["fc.weight"] = t["fc.weight"][:, :96].clone()
        t["mask_hidden"] = t["mask_hidden"][..., :96].clone()

    rewrite_tensors(drafter, narrow)
    assert load_drafter(drafter).config.target_hidden_size == 32  # consistent on its own
    with pytest.raises(PairingError, match=r"hidden size mismatch.*expects target hidden size 32"
                                           r".*target has hidden_size 64"):
        load_pair(tiny["llama"], drafter, peagle())


def test_vocabulary_mismatch(tiny, tmp_path):
    drafter = edit_config(broken_copy(tiny["aws"], tmp_path), vocab_size=1024)
    with pytest.raises(PairingError, match=r"vocabulary mismatch: drafter vocab_size 1024 != target "
                                           r"vocab_size 512"):
        load_pair(tiny["llama"], drafter, peagle())


def test_tap_layer_beyond_target_depth(tiny, tmp_path):
    drafter = edit_config(broken_copy(tiny["aws"], tmp_path), eagle_aux_hidden_state_layer_ids=[2, 4, 9])
    with pytest.raises(PairingError, match=r"tap layers \[2, 4, 9\] out of range: the target has 8 "
                                           r"layers.*\[0, 8\]"):
        load_pair(tiny["llama"], drafter, peagle())


def test_negative_tap_layer(tiny, tmp_path):
    drafter = edit_config(broken_copy(tiny["aws"], tmp_path), eagle_aux_hidden_state_layer_ids=[-1, 4, 5])
    with pytest.raises(PairingError, match=r"tap layers \[-1, 4, 5\] out of range"):
        load_pair(tiny["llama"], drafter, peagle())


def test_parallel_drafting_without_mask_hidden(tiny):
    with pytest.raises(PairingError, match=r"needs the learned 'mask_hidden' tensor.*"
                                           r"use --spec-mode eagle3"):
        load_pair(tiny["llama"], tiny["eagle3"], peagle())


def test_plain_eagle3_head_runs_in_eagle3_mode(tiny):
    pair = load_pair(tiny["llama"], tiny["eagle3"], SpecConfig("eagle3", 3))
    assert pair.drafter.config.layout == "eagle3"
    assert not pair.drafter.config.supports_parallel
    target, drafter = pair.build()
    assert target is not None and drafter is not None


def test_mask_token_id_too_large(tiny, tmp_path):
    drafter = edit_config(broken_copy(tiny["aws"], tmp_path), ptd_token_id=10**6)
    with pytest.raises(PairingError, match=r"mask token id 1000000 out of range \[0, 512\)"):
        load_pair(tiny["llama"], drafter, peagle())


def test_mask_token_id_negative(tiny, tmp_path):
    drafter = edit_config(broken_copy(tiny["aws"], tmp_path), ptd_token_id=-1)
    with pytest.raises(PairingError, match=r"mask token id -1 out of range \[0, 512\)"):
        load_pair(tiny["llama"], drafter, peagle())


def test_conflicting_mask_token_ids(tiny, tmp_path):
    src = json.loads((tiny["aws"] / "config.json").read_text())
    drafter = edit_config(broken_copy(tiny["aws"], tmp_path), pard_token=src["ptd_token_id"] + 1)
    with pytest.raises(ConfigError, match=r"conflicting mask token ids .*pard_token.*ptd_token_id.*"
                                          r"keep one key"):
        load_drafter(drafter)


def test_k_beyond_trained_depth_warns_and_loads(tiny, caplog):
    with caplog.at_level(logging.WARNING, logger="peagle_trt.checkpoint.validate"):
        pair = load_pair(tiny["qwen3"], tiny["speculators"], peagle(9))
    assert pair.drafter.config.trained_depth == 8
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("K=9 exceeds the head's trained depth 8" in r.getMessage() for r in warnings)


def test_k_within_trained_depth_does_not_warn(tiny, caplog):
    with caplog.at_level(logging.WARNING, logger="peagle_trt.checkpoint.validate"):
        load_pair(tiny["qwen3"], tiny["speculators"], peagle(8))
    assert not any("trained depth" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- drafter tensors


def test_d2t_wrong_size(tiny, tmp_path):
    drafter = rewrite_tensors(broken_copy(tiny["aws"], tmp_path),
                              lambda t: t.update(d2t=t["d2t"][:-1].clone()))
    with pytest.raises(CheckpointError, match=r"d2t has shape \(383,\), expected \(384,\)"):
        load_drafter(drafter)


def test_d2t_missing_with_smaller_draft_vocab(tiny, tmp_path):
    drafter = rewrite_tensors(broken_copy(tiny["aws"], tmp_path), lambda t: t.pop("d2t"))
    with pytest.raises(CheckpointError, match=r"draft vocabulary \(384\) is smaller than the target "
                                              r"vocabulary \(512\) but there is no d2t map"):
        load_drafter(drafter)


def test_drafter_weight_missing_fails_at_build(tiny, tmp_path):
    name = "layers.1.mlp.up_proj.weight"
    drafter = rewrite_tensors(broken_copy(tiny["aws"], tmp_path), lambda t: t.pop(name))
    pair = load_pair(tiny["llama"], drafter, peagle())  # the light checks do not look at layer 1
    with pytest.raises(CheckpointError, match=r"drafter .*drafter-aws: weights missing from the checkpoint: "
                                              r"\['layers\.1\.mlp\.up_proj\.weight'\]"):
        pair.build()


# --------------------------------------------------------------------------- weight files


def test_missing_weight_file(tiny, tmp_path):
    target = broken_copy(tiny["llama"], tmp_path)
    (target / WEIGHTS).unlink()
    assert (target / "config.json").is_file()
    with pytest.raises(CheckpointError, match=r"no weights found; expected model\.safetensors or "
                                              r"model\.safetensors\.index\.json"):
        load_target(target)


def test_sharded_index_with_missing_shard(tmp_path):
    target = make_target(tmp_path / "sharded", "llama", shard=True)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    (target / shards[-1]).unlink()
    with pytest.raises(CheckpointError, match=rf"{shards[-1]}: weight file listed in "
                                              r"model\.safetensors\.index\.json is missing"):
        load_target(target)


def test_truncated_safetensors(tiny, tmp_path):
    target = broken_copy(tiny["llama"], tmp_path)
    data = (target / WEIGHTS).read_bytes()
    (target / WEIGHTS).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: .*truncated or corrupt"):
        load_target(target)


def test_corrupt_safetensors(tiny, tmp_path):
    drafter = broken_copy(tiny["aws"], tmp_path)
    (drafter / WEIGHTS).write_bytes(b"\xde\xad\xbe\xef this is not a safetensors file" * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: .*truncated or corrupt"):
        load_drafter(drafter)


def test_pickled_weights_are_refused(tiny, tmp_path):
    target = broken_copy(tiny["llama"], tmp_path)
    (target / WEIGHTS).unlink()
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2)}, target / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pickled weights \['pytorch_model\.bin'\]: "
                                              r"peagle-trt never unpickles checkpoints"):
        load_target(target)


def test_sharded_target_matches_single_file(tiny, tmp_path):
    sharded = make_target(tmp_path / "sharded", "llama", shard=True)  # same seed (0) as tiny['llama']
    assert (sharded / "model.safetensors.index.json").is_file()
    assert not (sharded / WEIGHTS).exists()
    a, b = load_target(tiny["llama"]), load_target(sharded)
    assert a.config == b.config
    assert a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        torch.testing.assert_close(a.tensors[name], b.tensors[name], rtol=0, atol=0, msg=name)


# --------------------------------------------------------------------------- config.json


def test_target_config_without_hidden_size(tiny, tmp_path):
    target = edit_config(broken_copy(tiny["llama"], tmp_path), remove=("hidden_size",))
    with pytest.raises(ConfigError, match=r"target .*config\.json: required key 'hidden_size' is missing"):
        load_target(target)


def test_drafter_config_without_num_attention_heads(tiny, tmp_path):
    drafter = edit_config(broken_copy(tiny["aws"], tmp_path), remove=("num_attention_heads",))
    with pytest.raises(ConfigError, match=r"drafter .*config\.json: required key 'num_attention_heads' "
                                          r"is missing"):
        load_drafter(drafter)


def test_speculators_config_without_transformer_layer_config(tiny, tmp_path):
    drafter = edit_config(broken_copy(tiny["speculators"], tmp_path), remove=("transformer_layer_config",))
    with pytest.raises(ConfigError, match=r"required key 'transformer_layer_config' is missing"):
        load_drafter(drafter)


def test_unsupported_target_model_type(tiny, tmp_path):
    target = edit_config(broken_copy(tiny["llama"], tmp_path), model_type="gpt2")
    with pytest.raises(ConfigError, match=r"target model_type 'gpt2' is not supported; "
                                          r"supported: \['gemma4', 'gemma4_text', 'gpt_oss', 'llama', 'qwen3', "
                                          r"'qwen3_moe'\]"):
        load_target(target)


# --------------------------------------------------------------------------- SpecConfig / SamplingParams


def test_unknown_spec_mode():
    with pytest.raises(ConfigError, match=r"spec mode 'medusa' is unknown; expected one of"):
        SpecConfig("medusa", 3)


def test_zero_spec_tokens_in_peagle_mode():
    with pytest.raises(ConfigError, match=r"num_spec_tokens must be in \[1, 64\], got 0"):
        SpecConfig("peagle", 0)


def test_negative_temperature():
    with pytest.raises(ConfigError, match=r"temperature must be >= 0, got -0\.5"):
        SamplingParams(temperature=-0.5)


@pytest.mark.parametrize("top_p", [0.0, 1.5])
def test_top_p_out_of_range(top_p):
    with pytest.raises(ConfigError, match=rf"top_p must be in \(0, 1\], got {top_p}"):
        SamplingParams(top_p=top_p)


def test_zero_max_tokens():
    with pytest.raises(ConfigError, match=r"max_tokens must be a positive integer, got 0"):
        SamplingParams(max_tokens=0)
