"""Building blocks shared by the target and the drafter: RMSNorm, GQA attention over a
`KVCache`, the SwiGLU MLP, and a pre-norm decoder layer. Parameter names follow Hugging Face
(`self_attn.q_proj`, `mlp.gate_proj`, ...) so checkpoints load by name."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from peagle_trt.models.kv_cache import KVCache
from peagle_trt.models.rope import apply_rope
from peagle_trt.ops import reference
from peagle_trt.ops.reference import kv_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, scale: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None  # scale=False: Gemma-4's v norm
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) if self.weight is None else self.weight * x.to(dtype)


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
                layer: int, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [B, S, in_dim]; cos/sin [B, S, d]; slots [B]; positions [B, S] (-1 = padding row)
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
        q = apply_rope(q.transpose(1, 2), cos, sin).transpose(1, 2).reshape(b, s, -1)  # [B, S, H*d]
        k = v = None
        if not self.kv_shared:
            k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
            v = k if self.v_proj is None else self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
            if hasattr(self, "k_norm"):
                k = self.k_norm(k)
                v = v if self.v_norm is None else self.v_norm(v)
            k = apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2).reshape(b, s, -1)  # [B, S, KV*d]
            v = v.reshape(b, s, -1)  # [B, S, KV*d]
        # PEagleKVAttention: write K/V at each row's absolute position, attend causally by position
        # (stale entries past a row, e.g. last step's rejected drafts, are never read)
        # a window spanning the whole cache (W >= T positions) cuts nothing: full attention
        window = self.window if self.window < cache.k[layer].shape[2] - 1 else 0
        if window or self.sinks is not None or self.kv_shared:
            # windows, sinks, read-only: the torch reference (the CUDA kernels do not implement them yet)
            out = reference.kv_attention(q, k, v, positions, slots, cache.k[layer], cache.v[layer],
                                         self.num_heads, self.num_kv_heads, self.head_dim, scale=self.scale,
                                         sliding_window=window, sinks=self.sinks)
        else:
            out = kv_attention(q, k, v, positions, slots, cache.k[layer], cache.v[layer],
                               self.num_heads, self.num_kv_heads, self.head_dim, self.scale)
        return self.o_proj(out)


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); act "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ACTIVATIONS[self.act](self.gate_proj(x)) * self.up_proj(x))


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

    def forward(self, x, cos, sin, cache, layer, slots, positions):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, slots, positions)
        return x + self.mlp(self.post_attention_layernorm(x))
