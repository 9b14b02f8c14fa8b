"""Runs INSIDE the speculators venv (.venv-speculators, scripts/speculators_env.sh), never in ours.

Writes EAGLE-3 / P-EAGLE heads with the `speculators` library's own training entry points and
runs the library's own PyTorch forward on fixed inputs, so tests/compat/ can check our loader and
drafter against the library. Usage:

    .venv-speculators/bin/python tests/compat/speculators_driver.py CASES.json OUT_DIR

CASES.json: a list of {"name", "type": "peagle"|"eagle3", "verifier": target dir, "flags": {...}
(DraftArgs fields: norm_before_fc, fc_norm, norm_output, norm_before_residual, embed_requires_grad,
draft_arch, target_layer_ids, sliding_window, full_attention_indices; unset ones take the
trainer's defaults), "draft_vocab_size": int|null, "mask_token_id": int, "depth": K, "seed"}.
For each case, OUT_DIR/heads/NAME is what `save_pretrained` wrote and OUT_DIR/oracle/NAME.safetensors
holds the inputs and the library's logits:
    hidden_states [1, L, A*H], input_ids [1, L], position_ids [1, L]
    ttt_logits [T, L, V_d]       Eagle3DraftModel.forward (sequential TTT steps, the EAGLE-3 path)
    peagle_logits [N, V_d], anchor_pos [N], depth [N]   PEagleDraftModel.forward (one parallel pass)
OUT_DIR/results.json: per case the resolved flags, or the library's refusal message.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import torch
from safetensors.torch import save_file

SEQ_LEN = 12  # rows of the fixed inputs


def trainer_flags(kind: str, verifier: str, overrides: dict) -> dict:
    """The trainer's resolved DraftArgs (its own defaults and derived defaults) + overrides."""
    from speculators.train.config.schema import TrainConfig

    draft = TrainConfig(speculator_type=kind, verifier={"verifier_name_or_path": verifier}).draft
    return {**draft.model_dump(), **overrides}


def build_head(case: dict):
    """The model exactly as `speculators train` builds it (train/cli.build_draft_model)."""
    from speculators.model import SpeculatorModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    flags = trainer_flags(case["type"], case["verifier"], case.get("flags", {}))
    layer_config = create_transformer_layer_config(
        verifier_name_or_path=case["verifier"], num_layers=flags["num_layers"],
        draft_arch=flags["draft_arch"], hidden_act=flags["draft_hidden_act"],
        sliding_window=flags["sliding_window"], full_attention_indices=flags["full_attention_indices"])
    t2d = d2t = None
    if case.get("draft_vocab_size"):
        gen = torch.Generator().manual_seed(case["seed"])
        counts = torch.randint(1, 1000, (layer_config.vocab_size,), generator=gen).tolist()
        d2t, t2d = build_vocab_mappings_from_distribution(dict(enumerate(counts)), case["draft_vocab_size"],
                                                          layer_config.vocab_size)
    model_class = SpeculatorModel.registry[case["type"]]
    model = model_class.from_training_args(
        verifier_config=layer_config, t2d=t2d, d2t=d2t, verifier_name_or_path=case["verifier"],
        draft_vocab_size=case.get("draft_vocab_size") or layer_config.vocab_size,
        norm_before_residual=flags["norm_before_residual"], norm_before_fc=flags["norm_before_fc"],
        fc_norm=flags["fc_norm"], norm_output=flags["norm_output"],
        embed_requires_grad=flags["embed_requires_grad"], target_layer_ids=flags["target_layer_ids"],
        mask_token_id=case.get("mask_token_id"), ttt_steps=case["depth"], num_depths=case["depth"],
        draft_attn_impl="eager")
    return model, flags


def randomize(model, seed: int) -> None:
    """Seeded weights of useful scale (a fresh head's init gives near-uniform logits). The
    verifier-owned embed_tokens / lm_head stay as the library loaded them from the target."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("embed_tokens", "lm_head", "verifier_")):
                continue
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif p.dim() == 2:
                p.copy_(noise / p.shape[1] ** 0.5)
            else:
                p.copy_(noise)


def oracle(model, case: dict) -> dict:
    """The library's own forwards on fixed inputs; logits captured at lm_head."""
    import speculators.models.peagle.core as peagle_core
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.core import Eagle3DraftModel

    gen = torch.Generator().manual_seed(case["seed"] + 1)
    width = model.fc.in_features
    hidden_states = torch.randn(1, SEQ_LEN, width, generator=gen)
    input_ids = torch.randint(0, model.verifier_vocab_size, (1, SEQ_LEN), generator=gen)
    position_ids = torch.arange(SEQ_LEN)[None]
    document_ids = torch.zeros(1, SEQ_LEN, dtype=torch.long)
    captured = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: captured.append(out.detach().clone()))
    out = {"hidden_states": hidden_states, "input_ids": input_ids, "position_ids": position_ids}
    with torch.no_grad():
        Eagle3DraftModel.forward(model, hidden_states, input_ids, document_ids,
                                 position_ids=position_ids, ttt_steps=case["depth"])
        out["ttt_logits"] = torch.cat(captured)  # [T, L, V_d]
        if case["type"] == "peagle":
            captured.clear()
            indices = {}
            real = peagle_core.generate_cod_sample_indices

            def recording(*args, **kwargs):
                indices["anchor_pos"], indices["depth"] = real(*args, **kwargs)
                return indices["anchor_pos"], indices["depth"]

            peagle_core.generate_cod_sample_indices = recording
            try:
                torch.manual_seed(case["seed"] + 2)  # COD sampling draws from the global RNG
                model.forward(hidden_states, input_ids, document_ids,
                              verifier_last_hidden_states=torch.randn(1, SEQ_LEN, model.hidden_size,
                                                                      generator=gen),
                              num_depths=case["depth"], down_sample_ratio=0.8, down_sample_ratio_min=0.5,
                              loss_config=resolve_loss_config("kl_div", "eager"))  # fused needs Triton
            finally:
                peagle_core.generate_cod_sample_indices = real
            out["peagle_logits"] = captured[0][0]  # [N, V_d]
            out.update(indices)
    hook.remove()
    return out


def main(cases_path: str, out_dir: str) -> int:
    from importlib.metadata import version

    cases = json.loads(Path(cases_path).read_text())
    out = Path(out_dir)
    (out / "heads").mkdir(parents=True, exist_ok=True)
    (out / "oracle").mkdir(parents=True, exist_ok=True)
    results = {"speculators_version": version("speculators"), "torch_version": torch.__version__, "cases": {}}
    t0 = time.perf_counter()
    for i, case in enumerate(cases, 1):
        print(f"[speculators-driver] {i}/{len(cases)} {case['name']}", flush=True)
        try:
            model, flags = build_head(case)
        except (ValueError, KeyError) as exc:  # the library refused the combination: record its reason
            results["cases"][case["name"]] = {"refused": str(exc)}
            continue
        randomize(model, case["seed"])
        model.eval()
        model.save_pretrained(out / "heads" / case["name"])
        tensors = oracle(model, case)
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  str(out / "oracle" / f"{case['name']}.safetensors"))
        results["cases"][case["name"]] = {"flags": flags}
    results["seconds"] = round(time.perf_counter() - t0, 2)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"[speculators-driver] {len(cases)} cases in {results['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(*sys.argv[1:]))
    except Exception:  # report everything to the parent test (it fails with this text)
        traceback.print_exc()
        sys.exit(1)
