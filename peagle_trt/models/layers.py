"""Building blocks shared by the target and the drafter: RMSNorm, GQA attention over a
`KVCache`, the SwiGLU MLP, and a pre-norm decoder layer. Parameter names follow Hugging Face
(`self_attn.q_proj`, `mlp.gate_proj`, ...) so checkpoints load by name.

Each module holds both of its views: `forward` (torch) and `write_onnx(w, ...)`, the same math
written node by node into the graph being assembled (`w`: the `ModelWriter` of
peagle_trt/export/graphs.py, which owns graph I/O, weights, FP8 linears, RoPE tables and the
model-local op functions). Writers return output names; no onnx import at module level.
Tests: tests/export/test_onnx.py and tests/e2e/test_families_e2e.py (onnxruntime equals torch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from peagle_trt.models.kv_cache import KVCache
from peagle_trt.models.rope import apply_rope
from peagle_trt.ops.reference import kv_attention

HEADS_IN_GEMM = 4  # the ONNX attention body's block-diagonal GQA up to this many KV heads (ops/onnx_defs.py)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis in fp32, rounded to x's dtype, times `weight` (None: no scale). A
    module-global name: `ops.kernels` routes it to the Triton kernel (ops/triton_kernels/norm_rope.py)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x.to(dtype) if weight is None else weight * x.to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, heads, d] rotated by cos / sin [B, S, d] -> [B, S, heads * d] (`apply_rope`; routed like
    `rms_norm`)."""
    b, s = x.shape[:2]
    return apply_rope(x.transpose(1, 2), cos, sin).transpose(1, 2).reshape(b, s, -1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, scale: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None  # scale=False: Gemma-4's v norm
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def write_onnx(self, w, x: str, name: str) -> str:
        """x [..., dim] -> RMSNorm over the last axis (parameter `{name}.weight`)."""
        weight = None if self.weight is None else w.param(f"{name}.weight", self.weight)
        return w.rmsnorm(x, weight, self.eps)

    def write_onnx_heads(self, w, x: str, name: str, heads: int, head_dim: int) -> str:
        """Per-head RMSNorm of x [B, S, heads * d]."""
        x4 = w.op("Reshape", x, w.ints(0, 0, heads, head_dim))
        return w.op("Reshape", self.write_onnx(w, x4, name), w.ints(0, 0, heads * head_dim))


class Attention(nn.Module):
    """GQA attention over a `KVCache`. Options (defaults: Llama): q/k per-head RMSNorm (Qwen3,
    Gemma), scale-free v norm, `scale` (None: 1/sqrt(d)), `k_eq_v` (no v_proj: values are the
    k_proj output), `kv_shared` (no k/v projections: reads the cache another layer wrote, which
    `KVCache` aliases to this layer's index), sliding `window`, GPT-OSS `sinks`."""

    def __init__(self, in_dim: int, out_dim: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool = False, qk_norm_eps: float | None = None, o_bias: bool = False,
                 window: int = 0, sinks: bool = False, scale: float | None = None, v_norm: bool = False,
                 k_eq_v: bool = False, kv_shared: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window = window  # 0: full attention; W: sliding window of W positions
        self.scale, self.kv_shared = scale, kv_shared
        self.q_proj = nn.Linear(in_dim, num_heads * head_dim, bias=bias)
        if not kv_shared:
            self.k_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=bias)
            self.v_proj = None if k_eq_v else nn.Linear(in_dim, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, out_dim, bias=o_bias)
        if qk_norm_eps is not None:  # Qwen3 / Gemma: per-head RMSNorm of q and k before RoPE
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            if not kv_shared:
                self.k_norm = RMSNorm(head_dim, qk_norm_eps)
                self.v_norm = RMSNorm(head_dim, qk_norm_eps, scale=False) if v_norm else None
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None  # GPT-OSS: [H] logits

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                layer: int, tables: torch.Tensor, positions: torch.Tensor,
                tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        # x [B, S, in_dim]; cos/sin [B, S, d]; tables [G, B, M] block tables (this layer reads its
        # group's, KVCache.groups); positions [B, S] (-1 = padding row); tree_mask [B, S, W] int32
        # | None: the rows' ancestor bits (a draft-tree verify, ops.reference.kv_attention)
        b, s, _ = x.shape
        q, k, v = self.project(x)  # [B, S, H*d], [B, S, KV*d] each (k, v None: KV-shared; v None: k is v)
        q = q.view(b, s, self.num_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
        q = rope(q, cos, sin)  # [B, S, H*d]
        if not self.kv_shared:
            k = k.view(b, s, self.num_kv_heads, self.head_dim)
            v = k if v is None else v.view(b, s, self.num_kv_heads, self.head_dim)
            if hasattr(self, "k_norm"):
                k = self.k_norm(k)
                v = v if self.v_norm is None else self.v_norm(v)
            k = rope(k, cos, sin)  # [B, S, KV*d]
            v = v.reshape(b, s, -1)  # [B, S, KV*d]
        # PEagleKVAttention: write K/V at each row's position through the block table, attend causally
        # by position (stale entries past a row, e.g. last step's rejected drafts, are never read)
        table = tables[cache.groups[layer]]  # [B, M]
        # a window spanning every position a request can have (W >= max_len) cuts nothing
        window = self.window if self.window < cache.max_len else 0
        # windows, sinks and read-only (KV-shared, k = v = None) layers included: the kernels take them all
        out = kv_attention(q, k, v, positions, table, cache.k[layer], cache.v[layer], self.num_heads,
                           self.num_kv_heads, self.head_dim, self.scale, window, self.sinks, tree_mask,
                           k_scale=cache.k_scale[layer], v_scale=cache.v_scale[layer])  # FP8 caches only
        return self.o_proj(out)

    def kv_scales(self) -> tuple[float, float]:
        """(k_scale, v_scale) of an FP8 KV cache for this layer: the checkpoint's calibrated scales
        (ModelOpt's k_proj.k_scale / v_proj.v_scale, peagle_trt/models/fp8.py) where present, else 1.0
        (vLLM's default for a checkpoint without them)."""
        def calibrated(name: str) -> float:
            scale = getattr(getattr(self, name, None), "kv_scale", None)
            return 1.0 if scale is None else float(scale)

        return calibrated("k_proj"), calibrated("v_proj")

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """q, k, v of x: three matmuls, or one where `fuse` joined them (`qkv_proj`, split into views);
        k = v = None for a KV-shared layer, v = None without a v projection (values are k)."""
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
            return q, k, v
        if self.kv_shared:
            return self.q_proj(x), None, None
        return self.q_proj(x), self.k_proj(x), None if self.v_proj is None else self.v_proj(x)

    def fuse(self) -> bool:
        """Join q, k, v into one matmul (`qkv_proj`, their weights stacked: one weight read, one launch);
        plain nn.Linear projections only (FP8 ones keep their own scales). True when fused."""
        if hasattr(self, "qkv_proj") or self.kv_shared or self.v_proj is None:
            return False
        parts = [self.q_proj, self.k_proj, self.v_proj]
        if any(type(m) is not nn.Linear for m in parts):
            return False
        self.qkv_proj, self.qkv_sizes = stacked(parts), [m.out_features for m in parts]
        del self.q_proj, self.k_proj, self.v_proj
        return True

    def write_onnx(self, w, x: str, layer: int, prefix: str, cos: str, sin: str, positions: str, table: str,
                   past: tuple[str, str] | None, present: tuple[str, str] | None,
                   source: int | None = None) -> str:
        """x [B, S, in_dim] -> [B, S, out_dim] through one PEagleKVAttention node writing
        `present` from `past` through `table` [B, M] (this layer's KV group's block tables).
        `source`: for a KV-shared layer, the layer owning the cache it reads. That layer's op already
        wrote this forward's keys; the shared op re-writes the same k/v at the same rows (idempotent)
        into a copy nobody reads, so the op contract stays one op."""
        from peagle_trt.ops.names import DOMAIN, KV_ATTENTION
        from peagle_trt.ops.onnx_defs import kv_attention_function, plugin_attrs

        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = w.linear(x, self.q_proj, f"{prefix}.q_proj")
        if hasattr(self, "q_norm"):  # Qwen3 / Gemma: per-head RMSNorm before RoPE
            q = self.q_norm.write_onnx_heads(w, q, f"{prefix}.q_norm", h, d)
        q = w.rope(q, h, d, cos, sin)
        if self.kv_shared:
            k, v, past, kv_scales = w.written[source]  # the owner's present_*: its cache after its write
            present = (w.name(f"{prefix}.k_cache_copy"), w.name(f"{prefix}.v_cache_copy"))
        else:
            kv_scales = self.kv_scales()
            k = w.linear(x, self.k_proj, f"{prefix}.k_proj")
            v = k if self.v_proj is None else w.linear(x, self.v_proj, f"{prefix}.v_proj")
            if hasattr(self, "k_norm"):
                k = self.k_norm.write_onnx_heads(w, k, f"{prefix}.k_norm", kv, d)
                if self.v_norm is not None:
                    v = self.v_norm.write_onnx_heads(w, v, f"{prefix}.v_norm", kv, d)
            k = w.rope(k, kv, d, cos, sin)
            w.written[layer] = (k, v, present, kv_scales)
        scale = self.scale if self.scale is not None else float(d) ** -0.5
        if KV_ATTENTION not in w.functions:
            w.functions[KV_ATTENTION] = kv_attention_function(w.np, self.sinks is not None, w.tree_mask is not None,
                                                              w.kv_fp8, self.num_kv_heads <= HEADS_IN_GEMM)
        extra = [w.param(f"{prefix}.sinks", self.sinks)] if self.sinks is not None else []
        if w.tree_mask is not None:  # the target graph: draft-tree verifies (an empty name: no sinks)
            extra = (extra or [""]) + [w.tree_mask]
        # a window spanning every position a request can have (W >= max_len) cuts nothing: no attribute
        window = {"sliding_window": self.window} if 0 < self.window < w.max_len else {}
        fp8 = {"k_scale": kv_scales[0], "v_scale": kv_scales[1]} if w.kv_fp8 else {}  # the cache's (KVCache)
        out = w.op(KV_ATTENTION, q, k, v, positions, table, *past, *extra, domain=DOMAIN,
                   outputs=[w.name(f"{prefix}.attn"), *present], name=f"{prefix}.{KV_ATTENTION}",
                   **plugin_attrs(num_heads=h, num_kv_heads=kv, head_dim=d, scale=scale, **window, **fp8))
        return w.linear(out[0], self.o_proj, f"{prefix}.o_proj")


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def stacked(linears: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear computing `linears` side by side (weights and biases concatenated on the output axis)."""
    first = linears[0]
    out = nn.Linear(first.in_features, sum(m.out_features for m in linears), bias=first.bias is not None,
                    device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(torch.cat([m.weight for m in linears]))
        if first.bias is not None:
            out.bias.copy_(torch.cat([m.bias for m in linears]))
    return out


def fuse_projections(model: nn.Module) -> int:
    """Fuse every `Attention` / `MLP` of `model` in place (their `fuse`): on a GPU at small batch each
    matmul is a launch and a weight stream of its own, so one per group reads the same bytes in fewer,
    fuller launches. Returns the modules fused. Export (write_onnx) needs the unfused model."""
    return sum(m.fuse() for m in model.modules() if isinstance(m, (Attention, MLP)))


def write_onnx_act(w, x: str, act: str) -> str:
    """ACTIVATIONS[act] as nodes: silu, else gelu_tanh."""
    return w.silu(x) if act == "silu" else w.gelu_tanh(x, w.np)


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); act "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):  # fused (`fuse`)
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(ACTIVATIONS[self.act](gate) * up)

    def fuse(self) -> bool:
        """Join gate and up into one matmul (`gate_up_proj`); plain nn.Linear only. True when fused."""
        parts = [getattr(self, "gate_proj", None), getattr(self, "up_proj", None)]
        if any(type(m) is not nn.Linear for m in parts):
            return False
        self.gate_up_proj = stacked(parts)
        del self.gate_proj, self.up_proj
        return True

    def write_onnx(self, w, x: str, prefix: str) -> str:
        gate = write_onnx_act(w, w.linear(x, self.gate_proj, f"{prefix}.gate_proj"), self.act)
        return w.linear(w.op("Mul", gate, w.linear(x, self.up_proj, f"{prefix}.up_proj")),
                        self.down_proj, f"{prefix}.down_proj")


class DecoderLayer(nn.Module):
    """Pre-norm Llama/Qwen3 layer: x + attn(norm(x)), then x + mlp(norm(x)).

    `attn` / `mlp` replace the default Llama attention / SwiGLU MLP (the target builds them from
    its resolved config: windows, sinks, output bias, sparse MoE)."""

    def __init__(self, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float, attention_bias: bool = False, mlp_bias: bool = False,
                 qk_norm: bool = False, attn: nn.Module | None = None, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = attn or Attention(hidden, hidden, num_heads, num_kv_heads, head_dim,
                                           attention_bias, eps if qk_norm else None)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = mlp or MLP(hidden, intermediate, mlp_bias)

    def forward(self, x, cos, sin, cache, layer, tables, positions, tree_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, tables, positions, tree_mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def write_onnx(self, w, x: str, i: int, cos: str, sin: str, positions: str, table: str,
                   past: tuple[str, str] | None, present: tuple[str, str] | None, pli: str | None = None,
                   source: int | None = None) -> str:
        """Layer `i` as nodes (x [B, S, H] -> [B, S, H]); `pli` and `source` are the Gemma-4
        layer's (per-layer inputs, KV sharing) and unused here."""
        p = f"layers.{i}"
        h = self.input_layernorm.write_onnx(w, x, f"{p}.input_layernorm")
        x = w.op("Add", x, self.self_attn.write_onnx(w, h, i, f"{p}.self_attn", cos, sin, positions, table,
                                                     past, present))
        h = self.post_attention_layernorm.write_onnx(w, x, f"{p}.post_attention_layernorm")
        return w.op("Add", x, self.mlp.write_onnx(w, h, f"{p}.mlp"))
