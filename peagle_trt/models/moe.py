"""Sparse mixture-of-experts MLP (Qwen3-MoE, GPT-OSS, Gemma-4) of the target, and its ONNX node.

Parameters (our canonical layout; peagle_trt/checkpoint/experts.py stacks a checkpoint's per-expert
linears into it, the adapters in peagle_trt/checkpoint/adapters/ map the stacked layouts):

    gate.weight [E, H] (+ gate.bias [E], GPT-OSS's router bias)      the router, never quantized
    experts.gate_up_proj [E, 2I, H]   rows [0, I) gate, [I, 2I) up   (nn.Linear's [out, in], stacked)
    experts.down_proj    [E, H, I]
    experts.gate_up_proj_bias [E, 2I], experts.down_proj_bias [E, H]  (GPT-OSS)
    FP8 experts: the two weights float8_e4m3fn with `*_scale` (per expert [E], per channel [E, N] or
    128 x 128 blocks [E, N/128, K/128]) and, for static activation scales (ModelOpt), `*_input_scale` [E]

The math is the PEagleMoE op's (peagle_trt/ops/reference.py `moe`, docs/EXPORT.md "PEagleMoE"):
routing in float32 (softmax-top-k, renormalised or not, or top-k-softmax; Gemma-4's per-expert
scale), per routed expert gate/up, the activation, down, the routing-weighted sum over the picks.
The forward calls the op once, by the module-global name `fused_moe`; none of its paths reads the
device back:

- on a CPU, the op's reference: each expert a row picked runs once over its rows, the routing read
  through a CPU tensor's numpy view (no device read, as the step's CPU argmax);
- on a GPU (and in the kernels' CPU rehearsal), `ops.kernels.install()` swaps `fused_moe` for the
  Triton kernel (peagle_trt/ops/triton_kernels/moe.py): routing, expert alignment and the grouped
  GEMMs stay on the device, so a MoE target is captured in CUDA graphs like a dense one
  (peagle_trt/executors/graphs.py);
- in ONNX, one `PEagleMoE` node (`write_onnx`), whose model-local function body onnxruntime runs
  (peagle_trt/ops/onnx_defs.py `moe_function`: onnxruntime's own `com.microsoft::MoE` where its CPU
  kernel computes the family's activation, reading only the routed experts; the exact dense form for
  FP8 experts and GeGLU) and which TensorRT maps to the plugin launching the kernel's cubins.

Tests: tests/models/test_moe.py (the op against the contract spelled out, the ONNX bodies, FP8 kinds),
tests/ops/test_moe_kernel.py (the kernel against the op), tests/models/test_families.py (equal to
transformers' models), tests/e2e/test_families_e2e.py (onnxruntime equals torch),
tests/speculative/test_host_reads.py (one read per step with MoE targets).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from peagle_trt.architecture import MoEConfig
from peagle_trt.errors import BuildError, CheckpointError
from peagle_trt.models.fp8 import FP8_DTYPE, FP8_MAX, is_fp8
from peagle_trt.models.layers import RMSNorm
from peagle_trt.ops import reference

fused_moe = reference.moe  # the op; ops.kernels.install() swaps in its dispatcher (kernel on the GPU)

PROJECTIONS = ("gate_up_proj", "down_proj")
ROUTING = {"softmax_topk": 0, "topk_softmax": 1}  # the PEagleMoE node's `routing` attribute
ACTIVATION = {"silu": 0, "gelu_tanh": 1, "clamped_swiglu": 2}  # its `activation` attribute
BLOCK = 128  # FP8 block scales: 128 x 128 weight blocks, 128-column activation groups


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class StackedExperts(nn.Module):
    """The E experts' weights, stacked (module docstring); FP8 after `make_fp8`."""

    def __init__(self, hidden: int, cfg: MoEConfig):
        super().__init__()
        e, i = cfg.num_experts, cfg.intermediate_size
        self.hidden, self.intermediate, self.num_experts = hidden, i, e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden))
        self.down_proj = nn.Parameter(torch.empty(e, hidden, i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i)) if cfg.expert_bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(e, hidden)) if cfg.expert_bias else None

    @property
    def fp8(self) -> bool:
        return self.gate_up_proj.dtype == FP8_DTYPE

    def make_fp8(self, scale_shapes: dict[str, tuple[int, ...]]) -> None:
        """Turn the weights into float8_e4m3fn and register their scales, empty, on the weights'
        device (meta included), with `scale_shapes` {name: shape} (`fp8_scale_shapes` checks them);
        the values are loaded afterwards (`load_strict`) or set by `quantize_experts`."""
        device = self.down_proj.device
        for proj in PROJECTIONS:
            w = getattr(self, proj)
            setattr(self, proj, _frozen(torch.empty(w.shape, dtype=FP8_DTYPE, device=device)))
        for name, shape in scale_shapes.items():
            setattr(self, name, _frozen(torch.empty(shape, dtype=torch.float32, device=device)))

    def scales(self, proj: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(weight scale, static activation scale or None) of one projection; (None, None) unquantized."""
        return getattr(self, f"{proj}_scale", None), getattr(self, f"{proj}_input_scale", None)

    def _apply(self, fn, recurse: bool = True):
        # As FP8Linear: `.to(dtype)` must not cast FP8 weights or their fp32 scales; they follow the device only
        if not self.fp8:
            return super()._apply(fn, recurse)
        device = fn(torch.empty(0, device=self.down_proj.device)).device
        for name, p in list(self._parameters.items()):
            if p is not None:
                self._parameters[name] = _frozen(fn(p) if name.endswith("_bias") else p.to(device))
        return self

    def op_args(self) -> dict:
        """The weights as `fused_moe`'s keyword arguments."""
        (s13, a13), (s2, a2) = self.scales("gate_up_proj"), self.scales("down_proj")
        return dict(w13=self.gate_up_proj, w2=self.down_proj, b13=self.gate_up_proj_bias, b2=self.down_proj_bias,
                    w13_scale=s13, w2_scale=s2, a13_scale=a13, a2_scale=a2)


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(hidden, cfg.num_experts, bias=cfg.router_bias)
        self.experts = StackedExperts(hidden, cfg)
        if cfg.router_input_norm:  # Gemma-4
            self.router_norm = RMSNorm(hidden, cfg.router_norm_eps, scale=False)
            self.router_scale = nn.Parameter(torch.ones(hidden))
        if cfg.per_expert_scale:
            self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))

    def router_input(self, flat: torch.Tensor) -> torch.Tensor:
        if not self.cfg.router_input_norm:
            return flat
        return self.router_norm(flat) * self.router_scale * flat.shape[-1] ** -0.5

    def op_attrs(self) -> dict:
        """The op's routing and activation settings (`fused_moe`'s keyword arguments)."""
        c = self.cfg
        return dict(top_k=c.top_k, routing=c.routing, renormalize=c.norm_topk_prob, activation=c.activation,
                    swiglu_alpha=c.swiglu_alpha, swiglu_limit=c.swiglu_limit)

    def expert_scale(self) -> torch.Tensor | None:
        return self.per_expert_scale.float() if self.cfg.per_expert_scale else None

    def forward(self, x: torch.Tensor, router_x: torch.Tensor | None = None) -> torch.Tensor:
        # x [..., H] expert input; router_x [..., H] what the router sees (default x)
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [T, H]
        r = flat if router_x is None else router_x.reshape(-1, shape[-1])
        logits = self.gate(self.router_input(r))  # [T, E]
        out = fused_moe(flat, logits, expert_scale=self.expert_scale(), **self.experts.op_args(), **self.op_attrs())
        return out.reshape(shape)

    # -- ONNX ------------------------------------------------------------------------------------
    def write_onnx(self, w, x: str, prefix: str, router_x: str | None = None) -> str:
        """x [B, S, H] -> [B, S, H] through one PEagleMoE node (module docstring); router_x: what the
        router sees (default x; Gemma-4 passes the block input, with its router norm and scales)."""
        from onnx import TensorProto

        from peagle_trt.ops.names import DOMAIN, MOE
        from peagle_trt.ops.onnx_defs import moe_function, plugin_attrs

        cfg, hidden = self.cfg, self.gate.in_features
        flat = w.op("Reshape", x, w.ints(-1, hidden))  # [N, H]
        r = flat if router_x is None else w.op("Reshape", router_x, w.ints(-1, hidden))
        if cfg.router_input_norm:
            r = w.op("Mul", w.op("Mul", self.router_norm.write_onnx(w, r, f"{prefix}.router_norm"),
                                 w.param(f"{prefix}.router_scale", self.router_scale)),
                     w.const(np.asarray(hidden ** -0.5, dtype=w.np)))
        logits = w.op("Cast", w.linear(r, self.gate, f"{prefix}.gate"), to=TensorProto.FLOAT)  # [N, E] f32
        form = moe_form(self)
        if MOE in w.functions and w.functions[MOE].doc_string != repr(form):
            raise BuildError(f"{prefix}: the MoE layers of one model must share one form (routing, activation, "
                             f"FP8 scales), got {form} after {w.functions[MOE].doc_string}")
        w.functions.setdefault(MOE, moe_function(form, w.dtype))
        inputs = [flat, logits] + [_write_tensor(w, f"{prefix}.experts.{n}", t) if t is not None else ""
                                   for n, t in _node_tensors(self).items()]
        out = w.op(MOE, *inputs, domain=DOMAIN, name=w.name(MOE),
                   **plugin_attrs(top_k=cfg.top_k, routing=ROUTING[cfg.routing], renormalize=int(cfg.norm_topk_prob),
                                  activation=ACTIVATION[cfg.activation], swiglu_alpha=float(cfg.swiglu_alpha),
                                  swiglu_limit=float(cfg.swiglu_limit)))
        return w.op("Reshape", out, w.op("Shape", x))


# -- FP8 experts -------------------------------------------------------------------------------------

def fp8_scale_shapes(tensors: dict, prefix: str, ex: StackedExperts, what: str) -> dict | None:
    """{scale name: shape} of `prefix`.experts's FP8 scales in `tensors` (None: not FP8), checked
    against the op's three kinds; CheckpointError names what is wrong."""
    weights = {p: tensors.get(f"{prefix}.{p}") for p in PROJECTIONS}
    if not any(t is not None and is_fp8(t) for t in weights.values()):
        return None
    shapes = {}
    for proj, weight in weights.items():
        name = f"{prefix}.{proj}"
        if weight is None or weight.dtype != FP8_DTYPE:
            raise CheckpointError(f"{what}: {name} is {None if weight is None else weight.dtype}; FP8 experts "
                                  "need both projections in float8_e4m3fn")
        scale, act = tensors.get(f"{name}_scale"), tensors.get(f"{name}_input_scale")
        if scale is None:
            raise CheckpointError(f"{what}: FP8 expert weight {name!r} has no {name + '_scale'!r}")
        e, n, k = weight.shape
        kinds = {(e,): "per expert", (e, n): "per channel", (e, -(-n // BLOCK), -(-k // BLOCK)): "128x128 blocks"}
        if tuple(scale.shape) not in kinds:
            raise CheckpointError(f"{what}: {name + '_scale'!r} has shape {tuple(scale.shape)}; expected one of "
                                  f"{', '.join(f'{s} ({v})' for s, v in kinds.items())}")
        shapes[f"{proj}_scale"] = tuple(scale.shape)
        if act is not None:
            if tuple(act.shape) != (e,):
                raise CheckpointError(f"{what}: {name + '_input_scale'!r} has shape {tuple(act.shape)}, "
                                      f"expected ({e},): one static activation scale per expert")
            shapes[f"{proj}_input_scale"] = (e,)
    return shapes


def fp8_experts_swap(model: nn.Module, tensors: dict, what: str = "checkpoint") -> list[str]:
    """Make FP8 the StackedExperts of `model` whose checkpoint weights are FP8 (before `load_strict`,
    which then checks the values by name and shape). Returns their module names."""
    swapped = []
    for name, module in model.named_modules():
        if isinstance(module, StackedExperts):
            shapes = fp8_scale_shapes(tensors, name, module, what)
            if shapes is not None:
                module.make_fp8(shapes)
                swapped.append(name)
    return swapped


def fp8_experts(model: nn.Module) -> dict[str, StackedExperts]:
    """The FP8 stacked experts of a model, by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, StackedExperts) and m.fp8}


@torch.no_grad()
def quantize_experts(moe: SparseMoE, kind: str = "block", act_scale: float | None = None) -> None:
    """Quantize `moe`'s experts to FP8 E4M3 in place, from their current weights: `kind` "tensor"
    (one scale per expert), "channel" (per output row) or "block" (128 x 128, as block-FP8 MoE
    checkpoints ship them); `act_scale`: the amax of a static activation scale for every expert
    (ModelOpt's form: per-tensor weights always have one, 4.0 if not given, as peagle_trt/bench/gpu.py
    `to_fp8`), None for dynamic activation scales. For random-weight targets at real shapes (bench seeds)."""
    ex = moe.experts
    if kind not in ("tensor", "channel", "block"):
        raise ValueError(f"FP8 expert scales are 'tensor', 'channel' or 'block', got {kind!r}")
    if kind == "block" and act_scale is not None:
        raise ValueError("block-scaled FP8 experts quantize their activations per 128-column group: no act_scale")
    if kind == "tensor" and act_scale is None:
        act_scale = 4.0
    if ex.fp8:
        raise ValueError("the experts are FP8 already")
    values, shapes = {}, {}
    for proj in PROJECTIONS:
        w = getattr(ex, proj).float()  # [E, N, K]
        e, n, k = w.shape
        if kind == "tensor":
            amax = w.abs().amax(dim=(1, 2))  # [E]
        elif kind == "channel":
            amax = w.abs().amax(dim=2)  # [E, N]
        else:
            padded = F.pad(w, (0, -k % BLOCK, 0, -n % BLOCK))
            amax = padded.reshape(e, padded.shape[1] // BLOCK, BLOCK, padded.shape[2] // BLOCK, BLOCK
                                  ).abs().amax(dim=(2, 4))  # [E, N/128, K/128]
        scale = amax.clamp(min=1e-12) / FP8_MAX
        codes = (w / reference.moe_expand_scale(scale, w.shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        values[proj], values[f"{proj}_scale"] = codes, scale
        shapes[f"{proj}_scale"] = tuple(scale.shape)
        if act_scale is not None:
            values[f"{proj}_input_scale"] = torch.full((e,), act_scale / FP8_MAX, device=w.device)
            shapes[f"{proj}_input_scale"] = (e,)
        del w
    ex.make_fp8(shapes)
    for name, v in values.items():
        getattr(ex, name).data = v


# -- the ONNX node's tensors -------------------------------------------------------------------------

def _node_tensors(moe: SparseMoE) -> dict:
    """The PEagleMoE node's inputs after (x, router_logits), in order (None: absent)."""
    ex = moe.experts
    (s13, a13), (s2, a2) = ex.scales("gate_up_proj"), ex.scales("down_proj")
    return {"gate_up_proj": ex.gate_up_proj, "down_proj": ex.down_proj, "gate_up_proj_bias": ex.gate_up_proj_bias,
            "down_proj_bias": ex.down_proj_bias, "expert_scale": moe.expert_scale(), "gate_up_proj_scale": s13,
            "down_proj_scale": s2, "gate_up_proj_input_scale": a13, "down_proj_input_scale": a2}


def _write_tensor(w, name: str, t: torch.Tensor) -> str:
    """An initializer: FP8 weights as FLOAT8E4M3FN, scales in float32, the rest in the export dtype."""
    from onnx import TensorProto, helper

    if t.dtype == FP8_DTYPE:
        raw = t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
        return w.weight(name, helper.make_tensor(name, TensorProto.FLOAT8E4M3FN, list(t.shape), raw, raw=True))
    if t.dtype == torch.float32 and (name.endswith("_scale") or name.endswith("expert_scale")):
        return w.weight(name, t.detach().cpu().numpy())
    return w.param(name, t)


def moe_form(moe: SparseMoE):
    """The ONNX body form of `moe` (peagle_trt/ops/onnx_defs.py `MoEForm`)."""
    from peagle_trt.ops.onnx_defs import MoEForm

    c, ex = moe.cfg, moe.experts
    fp8 = None
    if ex.fp8:
        kinds = {1: "tensor", 2: "channel", 3: "block"}
        fp8 = tuple(kinds[ex.scales(p)[0].dim()] for p in PROJECTIONS)
    return MoEForm(c.top_k, c.routing, c.norm_topk_prob, c.activation, c.swiglu_alpha, c.swiglu_limit, fp8,
                   ex.scales("gate_up_proj")[1] is not None, ex.gate_up_proj_bias is not None, c.per_expert_scale)
