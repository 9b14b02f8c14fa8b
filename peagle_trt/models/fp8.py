"""FP8 (E4M3) linear layers for checkpoints quantized by ModelOpt (`peagle-trt quantize`).

A ModelOpt FP8 checkpoint (per-tensor, static scales) stores, for every quantized `nn.Linear` X:

    X.weight        float8_e4m3fn [out, in]   = W / weight_scale, rounded to E4M3
    X.weight_scale  float32 scalar            = amax(W) / 448
    X.input_scale   float32 scalar            = calibrated amax(x) / 448
    X.k_scale / X.v_scale (k_proj / v_proj, FP8 KV cache only): scale of the cached K / V

`FP8Linear` computes what ModelOpt's fake quantization computes, written the way ONNX
QuantizeLinear / DequantizeLinear define it (docs/EXPORT.md, "FP8"):

    x_q = fp8(clamp(x / input_scale, -448, 448)) * input_scale
    y   = x_q @ (float(weight) * weight_scale)^T (+ bias)

`fp8_swap(model, tensors)` replaces the `nn.Linear` modules whose checkpoint weight is FP8 by
`FP8Linear` modules (meta device included), so `load_strict` then checks the weights and the
scales by name and shape like any other parameter. The FP8 weight and its fp32 scales keep
their dtypes when the model is cast (`.to(dtype)`); only the bias follows the model dtype.

Block-scaled FP8 checkpoints (Qwen3-Coder-30B-A3B-Instruct-FP8, DeepSeek-style `quant_method: fp8`,
`weight_block_size: [128, 128]`, dynamic activations) store instead

    X.weight            float8_e4m3fn [out, in]
    X.weight_scale_inv  [ceil(out / 128), ceil(in / 128)]   the dequantized weight is code * it, per block

and quantize activations per row and 128-column group at run time. `FP8Linear(block=True)` computes
that (the PEagleMoE op's block math, peagle_trt/ops/reference.py `quantize_activation` / `fp8_matmul`):
on every device the codes' products in float32, scaled per group (no Triton GEMM for blocks yet).

The KV-cache scales are kept (`FP8Linear.kv_scale`): an FP8 KV cache (`--kv-cache-dtype fp8`) stores
and reads that layer's K / V with them (`Attention.kv_scales`, peagle_trt/models/layers.py; the ONNX
node's k_scale / v_scale attributes); with the default cache (`auto`, the model's dtype) they are unused.

Paths (`linear_path`): `FP8Linear.forward` runs the dequantized matmul above ("dequant": the weight
copied to x's dtype on every call) everywhere but on CUDA with the kernels on (`ops.kernels.routed()`,
i.e. `TorchExecutor(kernels="cuda")`, or `ops.kernels.enable()`), outside deterministic mode. There
it multiplies FP8 by FP8 without a copy: rows M <= TRITON_MAX_M through the Triton FP8 GEMM
(ops/triton_kernels/fp8_linear.py: the weight as the FP8 MMA's wide operand (swap-AB), streamed by
cp.async in a NUM_STAGES pipeline, split-K with an in-order reduce where N gives too few programs,
scales fused; M <= 16 quantizes x in the GEMM, 16 < M <= 64 first, in its own kernel), more rows
through `torch._scaled_mm` (K and N multiples of 16). Both compute `fp8_linear_reference` (fp32
accumulation, one rounding to x's dtype), which differs from the dequant path by that path's bf16
roundings only. The Triton GEMM's row bits do not depend on M (its K order comes from (N, K) alone);
`_scaled_mm` (cuBLASLt) picks its kernel by shape, so a row's bits change where M crosses
TRITON_MAX_M: deterministic mode (`ops.deterministic.rows()`) therefore stays on the dequant path,
whose row-blocked F.linear gives a row the same bits in any batch. Unmeasured: the GEMM's speed
(unmeasured on a GPU so far; TRITON_MAX_M too). CPU results are unchanged.
How to test: tests/quantize/test_fp8.py (the dequant path), tests/ops/test_fp8_linear.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from peagle_trt.errors import CheckpointError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3 value
KV_SCALE_NAMES = ("k_scale", "v_scale")


def is_fp8(tensor: torch.Tensor) -> bool:
    """True for any 8-bit float dtype (E4M3, E5M2, their fnuz variants, E8M0)."""
    return tensor.is_floating_point() and tensor.element_size() == 1


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize to E4M3 with a per-tensor scale and dequantize again (in float32; result in x.dtype)."""
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return (q.float() * scale).to(x.dtype)


BLOCK = 128  # block-scaled FP8: weight blocks of 128 x 128, activation groups of 128 columns
TRITON_MAX_M = 64  # rows up to which the Triton FP8 GEMM runs; `_scaled_mm` above (to be measured: bench kernels)


def quantize_input(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes of x / input_scale (clamped to +-448): the activation side of the FP8 matmul."""
    return (x.float() / input_scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         input_scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8 product in fp32, rounded once to x's dtype: (codes(x) @ weight^T) * input_scale *
    weight_scale + bias, codes(x) = `quantize_input`. x [..., K], weight float8_e4m3fn [N, K] -> [..., N].
    The reference of the Triton FP8 GEMM and of `torch._scaled_mm` (tests/ops/test_fp8_linear.py)."""
    prod = quantize_input(x, input_scale).float() @ weight.float().t()  # [..., N] fp32
    y = prod * (input_scale.float() * weight_scale.float()).reshape(())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def choose_path(rows: int, in_features: int, out_features: int, *, cuda: bool, kernels_on: bool,
                deterministic: bool) -> str:
    """"dequant", "triton" or "scaled_mm" for a product of `rows` rows (module docstring)."""
    if not cuda or not kernels_on or deterministic:
        return "dequant"
    if rows <= TRITON_MAX_M or in_features % 16 or out_features % 16:  # _scaled_mm wants multiples of 16
        return "triton"
    return "scaled_mm"


def linear_path(x: torch.Tensor, in_features: int, out_features: int) -> str:
    """How `FP8Linear.forward` multiplies x: `choose_path` on x's rows, device and the kernels' state."""
    if not x.is_cuda or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return "dequant"  # CPU: not a single import more than before
    from peagle_trt.ops import deterministic, kernels

    return choose_path(x.numel() // max(in_features, 1), in_features, out_features, cuda=True,
                       kernels_on=kernels.in_use(), deterministic=deterministic.active())


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class FP8Linear(nn.Module):
    """y = fakequant(x) @ dequant(weight)^T + bias, with ModelOpt's per-tensor FP8 scales.

    Attributes (read by the ONNX exporter): `weight` float8_e4m3fn [out, in], `weight_scale` and
    `input_scale` float32 scalars, `kv_scale` (float32 scalar or None, k_proj / v_proj of an FP8
    KV cache), `bias` (model dtype or None)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 kv_scale_name: str | None = None, scale_shapes: dict | None = None, block: bool = False):
        # scale_shapes: stored shape of each scale, () or (1,) (default ()); load_strict checks it.
        # block: 128 x 128 block scales (`weight_scale_inv`) and dynamic activations (module docstring)
        super().__init__()
        shapes = scale_shapes or {}
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.weight = _frozen(torch.empty(out_features, in_features, dtype=FP8_DTYPE))
        if block:
            self.weight_scale_inv = _frozen(torch.empty(-(-out_features // BLOCK), -(-in_features // BLOCK),
                                                        dtype=torch.float32))
        else:
            self.weight_scale = _frozen(torch.empty(shapes.get("weight_scale", ()), dtype=torch.float32))
            self.input_scale = _frozen(torch.empty(shapes.get("input_scale", ()), dtype=torch.float32))
        self.bias = _frozen(torch.empty(out_features)) if bias else None
        self.kv_scale_name = kv_scale_name
        if kv_scale_name is not None:  # registered under the checkpoint's name (k_scale / v_scale)
            setattr(self, kv_scale_name,
                    _frozen(torch.empty(shapes.get(kv_scale_name, ()), dtype=torch.float32)))

    @property
    def kv_scale(self) -> torch.Tensor | None:
        return getattr(self, self.kv_scale_name) if self.kv_scale_name else None

    def dequantized_weight(self) -> torch.Tensor:
        """float32 [out, in] = weight * weight_scale (what ModelOpt's fake-quant weight holds); block:
        each 128 x 128 block times its weight_scale_inv."""
        if self.block:
            s = self.weight_scale_inv.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            return self.weight.float() * s[:self.out_features, :self.in_features]
        return self.weight.float() * self.weight_scale.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block:  # dynamic activations per row and 128-column group, float32 sums scaled per group
            from peagle_trt.ops.reference import fp8_matmul, quantize_activation

            flat = x.reshape(-1, self.in_features)
            codes, a = quantize_activation(flat, "block")
            y = fp8_matmul(codes, a, self.weight, self.weight_scale_inv, "block")
            y = y if self.bias is None else y + self.bias.float()
            return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        path = linear_path(x, self.in_features, self.out_features)
        if path == "triton":
            from peagle_trt.ops.triton_kernels import fp8_linear

            return fp8_linear.fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias)
        if path == "scaled_mm":  # mat1 row-major, mat2 column-major (weight.t() of a row-major [N, K])
            flat = quantize_input(x.reshape(-1, self.in_features), self.input_scale)
            y = torch._scaled_mm(flat, self.weight.t(), scale_a=self.input_scale.float().reshape(()),
                                 scale_b=self.weight_scale.float().reshape(()), out_dtype=x.dtype)
            y = y if self.bias is None else y + self.bias.to(x.dtype)
            return y.reshape(*x.shape[:-1], self.out_features)
        x = fake_quant_fp8(x, self.input_scale)
        return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)

    def _apply(self, fn, recurse: bool = True):
        # Module.to(dtype) / .half() would cast every floating tensor, FP8 weight and fp32 scales
        # included (fp32 -> bf16 loses scale precision). Here only the bias goes through `fn`;
        # the others follow `fn`'s device, read off a probe tensor.
        device = fn(torch.empty(0, device=self.weight.device)).device
        for name, p in list(self._parameters.items()):
            if p is not None:
                self._parameters[name] = _frozen(fn(p) if name == "bias" else p.to(device))
        return self

    def extra_repr(self) -> str:
        kv = f", {self.kv_scale_name}" if self.kv_scale_name else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fp8_e4m3{', 128x128 blocks' if self.block else ''}{kv}")


def fp8_swap(model: nn.Module, tensors: dict, what: str = "checkpoint") -> list[str]:
    """Replace each `nn.Linear` of `model` whose `tensors[f"{name}.weight"]` is FP8 by an
    `FP8Linear` on the same device (meta included); the weights are loaded afterwards (e.g. by
    `load_strict`). Returns the swapped module names ([] for an unquantized checkpoint: no-op).

    Two layouts: ModelOpt's per-tensor E4M3 (`weight_scale`, `input_scale`) and 128 x 128 blocks
    (`weight_scale_inv`, dynamic activations). Raises CheckpointError for others (per-channel scales,
    E5M2) and for FP8 tensors that are not the weight of a linear layer."""
    fp8_names = {k for k, t in tensors.items() if is_fp8(t)}
    if not fp8_names:
        return []
    swapped = []
    for name, module in list(model.named_modules()):
        key = f"{name}.weight"
        if type(module) is not nn.Linear or key not in fp8_names:
            continue
        weight = tensors[key]
        if weight.dtype != FP8_DTYPE:
            raise CheckpointError(f"{what}: {key!r} is {weight.dtype}; only float8_e4m3fn weights "
                                  "(ModelOpt FP8) are supported")
        inv = tensors.get(f"{name}.weight_scale_inv")
        if inv is not None:  # 128 x 128 block scales
            want = (-(-module.out_features // BLOCK), -(-module.in_features // BLOCK))
            if tuple(inv.shape) != want:
                raise CheckpointError(f"{what}: {name + '.weight_scale_inv'!r} has shape {tuple(inv.shape)}; "
                                      f"128 x 128 block scales of a {tuple(weight.shape)} weight are {want}")
            with torch.device(module.weight.device):
                new = FP8Linear(module.in_features, module.out_features, module.bias is not None, block=True)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
            swapped.append(name)
            fp8_names.discard(key)
            continue
        shapes = {}
        for scale in ("weight_scale", "input_scale", *KV_SCALE_NAMES):
            s = tensors.get(f"{name}.{scale}")
            if s is None:
                if scale in KV_SCALE_NAMES:
                    continue
                raise CheckpointError(f"{what}: FP8 weight {key!r} has no {f'{name}.{scale}'!r}; "
                                      "the checkpoint is incomplete (re-run `peagle-trt quantize`)")
            if s.numel() != 1:
                raise CheckpointError(
                    f"{what}: {f'{name}.{scale}'!r} has shape {tuple(s.shape)}; only per-tensor "
                    "(scalar) FP8 scales are supported (ModelOpt FP8_DEFAULT_CFG)")
            if not bool(torch.isfinite(s.float()).all()) or float(s) <= 0:
                raise CheckpointError(f"{what}: {f'{name}.{scale}'!r} = {float(s)} is not a positive "
                                      "finite scale; the checkpoint is corrupt (re-run the quantization)")
            shapes[scale] = tuple(s.shape)
        kv = [s for s in KV_SCALE_NAMES if f"{name}.{s}" in tensors]
        if len(kv) > 1:
            raise CheckpointError(f"{what}: {name!r} carries both k_scale and v_scale")
        with torch.device(module.weight.device):
            new = FP8Linear(module.in_features, module.out_features, module.bias is not None,
                            kv[0] if kv else None, shapes)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        swapped.append(name)
        fp8_names.discard(key)
    if fp8_names:
        raise CheckpointError(f"{what}: {sorted(fp8_names)[:3]} are FP8 but are not the weight of a "
                              "linear layer; only linear layers can be FP8 (embeddings, norms and "
                              "lm_head stay unquantized)")
    return swapped


def fp8_layers(model: nn.Module) -> dict[str, FP8Linear]:
    """The FP8 layers of a model, by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
