"""Per-expert MoE linears -> the stacked experts of peagle_trt/models/moe.py.

Released Qwen3-MoE checkpoints, and ModelOpt's FP8 exports of every family, store each expert as
three linears (`<prefix>.experts.{e}.gate_proj` / `up_proj` / `down_proj`, `.weight` [out, in]
and, when present, `.bias`, `.weight_scale`, `.input_scale`, or block FP8's `.weight_scale_inv`).
`stack_experts` joins them into our layout:

    <prefix>.experts.gate_up_proj [E, 2I, H] (gate rows, then up rows)   <- gate_proj, up_proj
    <prefix>.experts.down_proj    [E, H, I]                                <- down_proj
    ..._bias                      [E, 2I] / [E, H]
    ..._scale  FP8 weight scales: ModelOpt's per-linear scalars become [E] (gate's and up's equal)
               or per channel [E, 2I] (they differ); block FP8's [N/128, K/128] become [E, ...]
    ..._input_scale               [E] static activation scales (ModelOpt)

Families whose checkpoints are already stacked (GPT-OSS, Gemma-4) are mapped by their adapters.
Called by peagle_trt/checkpoint/target.py for every family (a no-op without per-expert tensors).
Tests: tests/checkpoint/test_experts.py.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

from peagle_trt.errors import CheckpointError

_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                         r"(weight|bias|weight_scale|input_scale|weight_scale_inv)$")
BLOCK = 128


def stack_experts(tensors: dict, where: str) -> dict:
    """`tensors` with every per-expert group replaced by its stacked tensors (module docstring)."""
    groups: dict[str, dict] = defaultdict(dict)  # prefix -> {(expert, linear, kind): tensor}
    out = {}
    for name, tensor in tensors.items():
        m = _PER_EXPERT.match(name)
        if m:
            groups[m.group(1)][(int(m.group(2)), m.group(3), m.group(4))] = tensor
        else:
            out[name] = tensor
    for prefix, parts in groups.items():
        out.update(_stack(prefix, parts, f"{where}: {prefix}"))
    return out


def _stack(prefix: str, parts: dict, where: str) -> dict:
    experts = sorted({e for e, _, _ in parts})
    if experts != list(range(len(experts))):
        raise CheckpointError(f"{where}: experts {experts[:8]}... are not numbered 0..{len(experts) - 1}")
    kinds = {kind for _, _, kind in parts}
    for e in experts:
        for linear in ("gate_proj", "up_proj", "down_proj"):
            for kind in kinds:
                if (e, linear, kind) not in parts:
                    raise CheckpointError(f"{where}: {prefix}.{e}.{linear}.{kind} is missing (the other experts "
                                          f"have it)")

    def get(linear: str, kind: str) -> list[torch.Tensor]:
        return [parts[(e, linear, kind)] for e in experts]

    def cat(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:  # [E, rows a + rows b, ...]
        return _stack_bytes([_cat_bytes(x, y) for x, y in zip(a, b)])

    out = {f"{prefix}.gate_up_proj": cat(get("gate_proj", "weight"), get("up_proj", "weight")),
           f"{prefix}.down_proj": _stack_bytes(get("down_proj", "weight"))}
    if "bias" in kinds:
        out[f"{prefix}.gate_up_proj_bias"] = cat(get("gate_proj", "bias"), get("up_proj", "bias"))
        out[f"{prefix}.down_proj_bias"] = torch.stack(get("down_proj", "bias"))
    if "weight_scale_inv" in kinds:  # block FP8: [N/128, K/128] per linear (dequantized = code * it)
        inter = parts[(0, "gate_proj", "weight")].shape[0]
        if inter % BLOCK:
            raise CheckpointError(f"{where}: block-scaled FP8 experts need an intermediate size divisible by "
                                  f"{BLOCK} (gate and up blocks apart), got {inter}")
        pairs = zip(get("gate_proj", "weight_scale_inv"), get("up_proj", "weight_scale_inv"))
        out[f"{prefix}.gate_up_proj_scale"] = torch.stack([torch.cat([g, u]) for g, u in pairs]).float()
        out[f"{prefix}.down_proj_scale"] = torch.stack(get("down_proj", "weight_scale_inv")).float()
    if "weight_scale" in kinds:  # ModelOpt per-tensor: one scalar per linear
        gate = torch.stack([s.reshape(()) for s in get("gate_proj", "weight_scale")]).float()  # [E]
        up = torch.stack([s.reshape(()) for s in get("up_proj", "weight_scale")]).float()
        if torch.equal(gate, up):
            out[f"{prefix}.gate_up_proj_scale"] = gate
        else:  # per channel: each row keeps its own linear's scale
            inter = parts[(0, "gate_proj", "weight")].shape[0]
            out[f"{prefix}.gate_up_proj_scale"] = torch.cat([gate[:, None].expand(-1, inter),
                                                             up[:, None].expand(-1, inter)], dim=1).contiguous()
        out[f"{prefix}.down_proj_scale"] = torch.stack([s.reshape(()) for s in get("down_proj", "weight_scale")]
                                                       ).float()
    if "input_scale" in kinds:  # ModelOpt's static activation scales; gate and up read the same input
        gate = torch.stack([s.reshape(()) for s in get("gate_proj", "input_scale")]).float()
        up = torch.stack([s.reshape(()) for s in get("up_proj", "input_scale")]).float()
        if not torch.equal(gate, up):
            e = int((gate != up).nonzero()[0])
            raise CheckpointError(f"{where}: expert {e}'s gate_proj and up_proj input scales differ "
                                  f"({float(gate[e])} vs {float(up[e])}) although they quantize the same input; "
                                  "the checkpoint was calibrated inconsistently (re-run `peagle-trt quantize`)")
        out[f"{prefix}.gate_up_proj_input_scale"] = gate
        out[f"{prefix}.down_proj_input_scale"] = torch.stack([s.reshape(()) for s in get("down_proj", "input_scale")]
                                                             ).float()
    return out


def _cat_bytes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.cat on the first axis, FP8 included (moved as bytes)."""
    if a.element_size() == 1 and a.is_floating_point():
        return torch.cat([a.view(torch.uint8), b.view(torch.uint8)]).view(a.dtype)
    return torch.cat([a, b])


def _stack_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack, FP8 included (moved as bytes)."""
    first = tensors[0]
    if first.element_size() == 1 and first.is_floating_point():
        return torch.stack([t.view(torch.uint8) for t in tensors]).view(first.dtype)
    return torch.stack(tensors)
