"""Does this drafter fit this target for this speculative config? One specific message per problem."""

from __future__ import annotations

import logging

from peagle_trt.architecture import TargetConfig
from peagle_trt.checkpoint.drafter import MASK_TOKEN_KEYS, DrafterCheckpoint
from peagle_trt.config import SpecConfig
from peagle_trt.errors import PairingError

log = logging.getLogger(__name__)


def resolve_taps(target: TargetConfig, drafter: DrafterCheckpoint) -> tuple[int, ...]:
    """Tap layers of the target feeding the drafter's fc (residual stream entering each layer)."""
    if drafter.config.aux_layer_ids:  # as written; the library counts fc's inputs from them
        return tuple(drafter.config.aux_layer_ids)
    if drafter.config.num_aux == 1:
        return (target.num_layers,)  # no aux states: the final (pre-norm) hidden state
    return tuple(target.default_taps)


def validate_pair(target: TargetConfig, drafter: DrafterCheckpoint, spec: SpecConfig) -> tuple[int, ...]:
    """Raise `PairingError` if the pair cannot serve `spec`; return the resolved tap layers."""
    d, where = drafter.config, f"drafter {drafter.path}"
    if d.target_hidden_size != target.hidden_size:
        raise PairingError(f"{where}: hidden size mismatch: the drafter's fc expects target hidden "
                           f"size {d.target_hidden_size} (fc input {d.num_aux}x{d.target_hidden_size}) "
                           f"but the target has hidden_size {target.hidden_size}; pick the drafter "
                           "trained for this target")
    if d.vocab_size != target.vocab_size:
        raise PairingError(f"{where}: vocabulary mismatch: drafter vocab_size {d.vocab_size} != target "
                           f"vocab_size {target.vocab_size}; the head was trained for another tokenizer")
    if not d.has_embed and d.hidden_size != target.hidden_size:
        raise PairingError(f"{where}: the drafter has no embed_tokens and its hidden size "
                           f"{d.hidden_size} differs from the target's {target.hidden_size}")
    taps = resolve_taps(target, drafter)
    if len(taps) != d.num_aux:
        raise PairingError(f"{where}: {len(taps)} tap layers {list(taps)} given but the drafter's fc "
                           f"fuses {d.num_aux} (eagle_aux_hidden_state_layer_ids needs {d.num_aux} ids)")
    top = target.num_layers  # id i = the residual stream entering layer i; num_layers = final (pre-norm)
    if any(not 0 <= t <= top for t in taps) or len(set(taps)) != len(taps):
        raise PairingError(f"{where}: tap layers {list(taps)} out of range: the target has "
                           f"{target.num_layers} layers, so taps must be distinct ids in [0, {top}] "
                           "(eagle_aux_hidden_state_layer_ids; the speculators library checks the same)")
    if spec.mode == "peagle":
        if not d.has_mask_hidden:
            raise PairingError(f"{where}: parallel drafting (spec mode 'peagle') needs the learned "
                               "'mask_hidden' tensor, which this checkpoint lacks: it is a plain "
                               "EAGLE-3 head; use --spec-mode eagle3")
        if d.mask_token_id is None:
            raise PairingError(f"{where}: parallel drafting needs a mask token id; none of "
                               f"{list(MASK_TOKEN_KEYS)} is set in config.json")
        if not 0 <= d.mask_token_id < target.vocab_size:
            raise PairingError(f"{where}: mask token id {d.mask_token_id} out of range "
                               f"[0, {target.vocab_size}); it must be a reserved id of the vocabulary")
    elif spec.mode == "eagle3" and d.has_mask_hidden:
        log.warning("%s: P-EAGLE head run sequentially (eagle3 mode); mask_hidden is unused", where)
    if spec.mode != "none" and d.trained_depth and spec.num_spec_tokens > d.trained_depth:
        log.warning("%s: K=%d exceeds the head's trained depth %d; slots past it are out of "
                    "distribution and acceptance will drop", where, spec.num_spec_tokens,
                    d.trained_depth)
    return taps
