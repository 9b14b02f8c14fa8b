"""The P-EAGLE kernels on the GPU from torch: the Triton kernels of peagle_trt/ops/triton_kernels,
compiled just in time by Triton on CUDA tensors (no TensorRT, no plugin library).

Same signatures and semantics as `peagle_trt.ops.reference` (the contract of docs/EXPORT.md), on CUDA
tensors, on torch's current stream:

    kv_attention(q, k, v, positions, block_tables, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale,
                 sliding_window, sinks, tree_mask)
    draft_inputs(pending_tokens, pending_hidden, num_pending, cur, embed_tokens, h_mask, k, mask_token_id)
    draft_sample(logits, d2t)
    moe(x, router_logits, w13, w2, b13, b2, expert_scale, w13_scale, w2_scale, a13_scale, a2_scale, *, top_k,
        routing, renormalize, activation, swiglu_alpha, swiglu_limit)       (PEagleMoE, triton_kernels/moe.py)

plus keyword-only extras: `out=` buffers (tests poison them), FP8 caches (`k_scale=`, `v_scale=`;
stored = value / scale) and forced tilings (`config=`, for `bench kernels`' sweeps). Two model ops
that are no custom op of the export go the same way, so a graph-replayed step launches one kernel
where torch launches ~8-10 (triton_kernels/norm_rope.py): the models' `rms_norm` and `rope`
(peagle_trt/models/layers.py). The custom ops' kernels, compiled ahead of time, are what the TensorRT
plugins launch (plugins/src/launcher/tritonLauncher.cpp).

Routing the torch executor through the kernels. The models call the op functions of
`peagle_trt.models.layers` and `peagle_trt.executors.torch` by module-global name; `install()` swaps
those names for dispatchers (once per process). A dispatcher runs the kernel when either

- it is inside `routed()`, which `TorchExecutor(kernels="cuda")` enters around each of its forwards:
  the kernel ALWAYS runs there (no fallback: an input the kernel cannot take raises its TypeError /
  ValueError), and only that executor is affected; or
- `enable()` was called (process-wide, for experiments and tests): the kernel runs on CUDA tensors of
  a supported dtype, and the reference serves everything else (CPU tensors, FP8 activations, a cache
  dtype other than q's or FP8). `disable()` undoes `enable()`.

Everywhere else the dispatchers call the reference, so installing them changes nothing by itself.
The MoE dispatcher replaces `fused_moe` of peagle_trt/models/moe.py (the models' one call of the op,
with the reference's signature).

Needs `triton` (pip install -c constraints.txt -e '.[dev]') and a CUDA device; without them, calls
raise `KernelsUnavailable`. Inside `rehearsal()` under Triton's interpreter (TRITON_INTERPRET=1) they
also take CPU tensors, so the kernels="cuda" executor runs end to end on a CPU, slowly: a rehearsal of
the GPU path (tests/ops/test_kernel_executor.py), not a product path. How to test:
tests/ops/test_triton_kernels.py and tests/ops/test_moe_kernel.py (every kernel against the reference:
interpreter on CPU, the GPU with PEAGLE_TRITON_DEVICE=cuda), tests/plugins/test_kernels_gpu.py (`pytest -m gpu`);
tests/executors/test_kernels_option.py (the option's plumbing and errors, CPU).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import threading
from types import ModuleType

import torch

from peagle_trt.errors import ConfigError
from peagle_trt.ops import reference

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP8 = getattr(torch, "float8_e4m3fn", None)  # FP8 KV caches (k_scale / v_scale)
_lock = threading.Lock()


class KernelsUnavailable(ConfigError):
    """triton is not installed, or there is no CUDA device."""


def load() -> tuple[ModuleType, ModuleType, ModuleType]:
    """The Triton kernel modules (kv_attention, draft_inputs, draft_sample); no CUDA device needed."""
    try:
        from peagle_trt.ops.triton_kernels import draft_inputs as di
        from peagle_trt.ops.triton_kernels import draft_sample as ds
        from peagle_trt.ops.triton_kernels import kv_attention as ka
    except ImportError as e:
        raise KernelsUnavailable(f"the P-EAGLE kernels need triton==3.9.0 ({e}): "
                                 "pip install -c constraints.txt -e '.[dev]'") from e
    return ka, di, ds


def available() -> bool:
    """True when a CUDA device is visible and triton imports."""
    if not torch.cuda.is_available():
        return False
    try:
        load()
    except KernelsUnavailable:
        return False
    return True


_REHEARSAL = contextvars.ContextVar("peagle_kernels_on_cpu", default=False)


@contextlib.contextmanager
def rehearsal():
    """Within (and under Triton's interpreter, TRITON_INTERPRET=1), the kernels also take CPU tensors:
    slowly, the GPU executor's whole path runs on a CPU (tests/ops/test_kernel_executor.py). Outside,
    kernels='cuda' on a CPU stays an error."""
    token = _REHEARSAL.set(True)
    try:
        yield
    finally:
        _REHEARSAL.reset(token)


def _interpreting(device: torch.device) -> bool:
    if device.type != "cpu" or not _REHEARSAL.get():  # every launch asks: the GPU's answer first
        return False
    from peagle_trt.ops.triton_kernels.common import interpreted

    return interpreted()


def _on(device: torch.device):
    """torch.cuda.device(device), nothing for the interpreter's CPU tensors."""
    return contextlib.nullcontext() if device.type == "cpu" else torch.cuda.device(device)


def _cuda(*tensors: torch.Tensor | None) -> tuple[ModuleType, ModuleType, ModuleType]:
    if all(t is None or _interpreting(t.device) for t in tensors):
        return load()
    if not torch.cuda.is_available():
        raise KernelsUnavailable("no CUDA device: the P-EAGLE kernels run on NVIDIA GPUs only "
                                 "(use peagle_trt.ops.reference on CPU)")
    mods = load()
    for t in tensors:
        if t is not None and t.device.type != "cuda":
            raise ValueError(f"the P-EAGLE kernels take CUDA tensors, got one on {t.device}")
    return mods


# -- the ops --------------------------------------------------------------------------------------

def kv_attention(q, k, v, positions, block_tables, k_cache, v_cache, num_heads, num_kv_heads, head_dim,
                 scale=None, sliding_window=0, sinks=None, tree_mask=None, *, k_scale=1.0, v_scale=1.0, out=None,
                 num_splits=None, config=None):
    """PEagleKVAttention on the GPU; see `triton_kernels.kv_attention.kv_attention` (num_splits: None =
    split over the context by shape, unsplit in deterministic mode; 1 = never; config: a forced tiling)."""
    ka, _, _ = _cuda(q, k, v, positions, block_tables, k_cache, v_cache, sinks, tree_mask)
    with _on(q.device):
        return ka.kv_attention(q, k, v, positions, block_tables, k_cache, v_cache, num_heads, num_kv_heads,
                               head_dim, scale, sliding_window, sinks, tree_mask, k_scale=k_scale, v_scale=v_scale,
                               out=out, num_splits=num_splits, config=config)


def draft_inputs(pending_tokens, pending_hidden, num_pending, cur, embed_tokens, h_mask, num_spec_tokens,
                 mask_token_id, *, out=None):
    """PEagleDraftInputs on the GPU; see `triton_kernels.draft_inputs.draft_inputs`."""
    _, di, _ = _cuda(pending_tokens, pending_hidden, num_pending, cur, embed_tokens, h_mask)
    with _on(pending_hidden.device):
        return di.draft_inputs(pending_tokens, pending_hidden, num_pending, cur, embed_tokens, h_mask,
                               num_spec_tokens, mask_token_id, out=out)


def draft_sample(logits, d2t, *, out=None):
    """PEagleDraftSample on the GPU; see `triton_kernels.draft_sample.draft_sample`."""
    _, _, ds = _cuda(logits, d2t)
    with _on(logits.device):
        return ds.draft_sample(logits, d2t, out=out)


def moe(x, router_logits, w13, w2, b13=None, b2=None, expert_scale=None, w13_scale=None, w2_scale=None,
        a13_scale=None, a2_scale=None, *, top_k, routing="softmax_topk", renormalize=False, activation="silu",
        swiglu_alpha=1.702, swiglu_limit=7.0, out=None, config=None):
    """PEagleMoE on the GPU; see `triton_kernels.moe.moe` (config: a forced `MoETiles`)."""
    _cuda(x, router_logits, w13, w2, b13, b2, expert_scale, w13_scale, w2_scale, a13_scale, a2_scale)
    from peagle_trt.ops.triton_kernels import moe as mk

    with _on(x.device):
        return mk.moe(x, router_logits, w13, w2, b13, b2, expert_scale, w13_scale, w2_scale, a13_scale, a2_scale,
                      top_k=top_k, routing=routing, renormalize=renormalize, activation=activation,
                      swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, out=out, config=config)


# -- routing the torch executor through the kernels -----------------------------------------------

_ROUTED = contextvars.ContextVar("peagle_kernels_routed", default=False)  # inside routed()
_GLOBAL = False  # enable() was called


def _use_kernel(supported: bool) -> bool:  # (routed: CUDA tensors, or CPU ones under the interpreter)
    if _ROUTED.get():
        return True  # kernels="cuda": always the kernel; it raises on what it cannot take
    return _GLOBAL and supported and available()


def in_use() -> bool:
    """True where the ops would run on the kernels (inside `routed()`, or after `enable()` with a GPU):
    also what switches `FP8Linear` to its FP8 matmuls (peagle_trt/models/fp8.py)."""
    return _use_kernel(True)


def _kv_attention_dispatch(q, k, v, positions, block_tables, k_cache, v_cache, num_heads, num_kv_heads,
                           head_dim, scale=None, sliding_window=0, sinks=None, tree_mask=None, *, k_scale=1.0,
                           v_scale=1.0):
    supported = (q.is_cuda and k_cache.is_cuda and q.dtype in _DTYPES
                 and k_cache.dtype in (q.dtype, _FP8) and k_cache.is_contiguous() and v_cache.is_contiguous())
    op = kv_attention if _use_kernel(supported) else reference.kv_attention
    return op(q, k, v, positions, block_tables, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale,
              sliding_window, sinks, tree_mask, k_scale=k_scale, v_scale=v_scale)


def _draft_inputs_dispatch(pending_tokens, pending_hidden, num_pending, cur, embed_tokens, h_mask,
                           num_spec_tokens, mask_token_id):
    supported = (pending_hidden.is_cuda and embed_tokens.is_cuda and pending_hidden.dtype in _DTYPES
                 and embed_tokens.dtype in _DTYPES)
    op = draft_inputs if _use_kernel(supported) else reference.draft_inputs
    return op(pending_tokens, pending_hidden, num_pending, cur, embed_tokens, h_mask, num_spec_tokens,
              mask_token_id)


def _draft_sample_dispatch(logits, d2t):
    supported = logits.is_cuda and logits.dtype in _DTYPES
    op = draft_sample if _use_kernel(supported) else reference.draft_sample
    return op(logits, d2t)


def _rms_norm_dispatch(x, weight, eps):
    if _use_kernel(x.is_cuda and x.dtype in _DTYPES):
        from peagle_trt.ops.triton_kernels import norm_rope

        return norm_rope.rms_norm(x, weight, eps)
    return _original("peagle_trt.models.layers", "rms_norm")(x, weight, eps)


def _rope_dispatch(x, cos, sin):
    if _use_kernel(x.is_cuda and x.dtype in _DTYPES and cos.dtype == x.dtype):
        from peagle_trt.ops.triton_kernels import norm_rope

        return norm_rope.rope(x, cos, sin)
    return _original("peagle_trt.models.layers", "rope")(x, cos, sin)


def _moe_dispatch(x, router_logits, w13, w2, b13=None, b2=None, expert_scale=None, w13_scale=None, w2_scale=None,
                  a13_scale=None, a2_scale=None, *, top_k, routing="softmax_topk", renormalize=False,
                  activation="silu", swiglu_alpha=1.702, swiglu_limit=7.0):
    supported = x.is_cuda and w13.is_cuda and x.dtype in _DTYPES
    op = moe if _use_kernel(supported) else _original("peagle_trt.models.moe", "fused_moe")
    return op(x, router_logits, w13, w2, b13, b2, expert_scale, w13_scale, w2_scale, a13_scale, a2_scale,
              top_k=top_k, routing=routing, renormalize=renormalize, activation=activation,
              swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)


_PATCHES = (("peagle_trt.models.layers", "kv_attention", _kv_attention_dispatch),
            ("peagle_trt.models.layers", "rms_norm", _rms_norm_dispatch),
            ("peagle_trt.models.layers", "rope", _rope_dispatch),
            ("peagle_trt.executors.torch", "draft_inputs", _draft_inputs_dispatch),
            ("peagle_trt.executors.torch", "draft_sample", _draft_sample_dispatch),
            ("peagle_trt.models.moe", "fused_moe", _moe_dispatch))
_saved: dict[tuple[str, str], object] = {}


def _original(module: str, name: str):
    """The function `install()` replaced (the module's own while none is installed)."""
    fn = _saved.get((module, name)) or getattr(importlib.import_module(module), name)
    if any(fn is patch for _, _, patch in _PATCHES):  # a dispatcher put back by hand after disable()
        raise RuntimeError(f"{module}.{name} is a kernels dispatcher but no original is saved: something "
                           "restored it after ops.kernels.disable(); call install() / disable() in order")
    return fn


def install() -> None:
    """Swap the models' op names for the dispatchers (idempotent; alone, it changes no result)."""
    with _lock:
        for module, name, fn in _PATCHES:
            mod = importlib.import_module(module)
            if getattr(mod, name) is not fn:
                _saved.setdefault((module, name), getattr(mod, name))
                setattr(mod, name, fn)


def require(device: torch.device) -> None:
    """Raise KernelsUnavailable unless the kernels can run on `device` (a CUDA device, triton installed)."""
    device = torch.device(device)
    if _interpreting(device):
        load()
        return
    if device.type != "cuda":
        raise KernelsUnavailable(f"kernels='cuda' needs the model on a CUDA device, got {device}; pass "
                                 "--device cuda (or kernels='reference' on CPU)")
    if not torch.cuda.is_available():
        raise KernelsUnavailable("kernels='cuda' but no CUDA device is visible (torch.cuda.is_available() "
                                 "is False); the P-EAGLE kernels run on NVIDIA GPUs only")
    load()


@contextlib.contextmanager
def routed():
    """Within this block (this thread / context only), the ops called by the torch models run on the
    Triton kernels, with no fallback. Used by `TorchExecutor(kernels="cuda")` around its forwards."""
    install()
    token = _ROUTED.set(True)
    try:
        yield
    finally:
        _ROUTED.reset(token)


def enable() -> None:
    """Route every CUDA call of the ops through the kernels, process-wide (CUDA tensors of supported
    dtypes only; the reference keeps serving the rest). Raises KernelsUnavailable if triton or the
    GPU is missing."""
    global _GLOBAL
    if not torch.cuda.is_available():
        raise KernelsUnavailable("no CUDA device: the P-EAGLE kernels run on NVIDIA GPUs only")
    load()
    install()
    _GLOBAL = True


def disable() -> None:
    """Undo `enable()` and restore the reference functions."""
    global _GLOBAL
    _GLOBAL = False
    with _lock:
        for (module, name), fn in list(_saved.items()):
            setattr(importlib.import_module(module), name, fn)
            del _saved[(module, name)]


def enabled() -> bool:
    return _GLOBAL
