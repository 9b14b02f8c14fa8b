"""The heads tests/compat/ asks the `speculators` library to write (names are test ids)."""

from __future__ import annotations

DEPTH = 3  # K the heads are written for (ttt_steps / num_depths)
NORMS = ("plain", "norm_before_fc", "fc_norm")
WINDOW = 8  # the windowed heads' sliding_window: shorter than the oracle inputs and the generations


def library_cases() -> list[dict]:
    """Every flag combination the library accepts (3 fc-norm variants x norm_output x
    norm_before_residual, for each head type), spread over Llama/Qwen3 targets and drafter
    layers, plus the trainer's defaults, vocabulary/tap/layer variants and one refused combination.
    Flags left out take the trainer's own defaults (`speculators train`)."""
    def case(name, kind, family, flags, seed, draft_vocab=None):
        return {"name": name, "type": kind, "family": family, "flags": flags, "draft_vocab_size": draft_vocab,
                "depth": DEPTH, "seed": seed}

    cases, seed = [], 10
    for kind in ("peagle", "eagle3"):
        for family in ("llama", "qwen3"):
            cases.append(case(f"{kind}-defaults-{family}", kind, family, {}, seed := seed + 1))
        i = 0
        for norm in NORMS:
            for norm_output in (False, True):
                for before_residual in (False, True):
                    family, arch = ("llama", "qwen3")[i % 2], ("llama", "qwen3")[(i // 2) % 2]
                    flags = {"norm_before_fc": norm == "norm_before_fc", "fc_norm": norm == "fc_norm",
                             "norm_output": norm_output, "norm_before_residual": before_residual,
                             "draft_arch": arch}
                    name = f"{kind}-{norm}-out{int(norm_output)}-nbr{int(before_residual)}-{arch}-on-{family}"
                    draft_vocab = 200 if i % 3 == 0 else None  # a pruned vocabulary (d2t / t2d)
                    cases.append(case(name, kind, family, flags, seed := seed + 1, draft_vocab))
                    i += 1
        cases.append(case(f"{kind}-2taps-final-2layers", kind, "llama",
                          {"target_layer_ids": [1, 8], "num_layers": 2, "full_attention_indices": [0],
                           "embed_requires_grad": True}, seed := seed + 1))
    cases.append(case("peagle-1tap-qwen3", "peagle", "qwen3", {"target_layer_ids": [3], "fc_norm": True},
                      seed := seed + 1))
    # small sliding windows (the trainer's default is 2048): sequences run past W (keys > p - W)
    cases.append(case("peagle-window8-2layers", "peagle", "llama",
                      {"sliding_window": WINDOW, "num_layers": 2, "full_attention_indices": [1]}, 97))
    cases.append(case("eagle3-window8-qwen3", "eagle3", "qwen3", {"sliding_window": WINDOW}, 98))
    both = {"norm_before_fc": True, "fc_norm": True}
    cases.append(case("refused-both-fc-norms", "eagle3", "qwen3", both, 99))
    return cases


WRITTEN = [c["name"] for c in library_cases() if not c["name"].startswith("refused")]
