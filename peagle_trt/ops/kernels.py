"""The P-EAGLE CUDA kernels (plugins/, libpeagle_kernels.so) called from torch through ctypes.

Same signatures and semantics as `peagle_trt.ops.reference` (the contract of docs/EXPORT.md), on CUDA
tensors, on torch's current stream:

    kv_attention(q, k, v, positions, block_tables, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale)
    draft_inputs(pending_tokens, pending_hidden, num_pending, cur, embed_tokens, h_mask, k, mask_token_id)
    draft_sample(logits, d2t)

plus keyword-only extras: `out=` buffers (tests poison them), FP8 caches (`k_scale=`, `v_scale=`;
stored = value / scale), `simple=True` (the CUDA-core attention kernel), `split=False` (no split-K).
The KV cache is paged (block tables, reference.kv_attention); the kernels implement neither
`sliding_window` nor `sinks` nor the read-only (k = v = None) form: those layers stay on the reference.

Routing the torch executor through the kernels. The models call the op functions of
`peagle_trt.models.layers` and `peagle_trt.executors.torch` by module-global name; `install()` swaps
those names for dispatchers (once per process). A dispatcher runs the kernel when either

- it is inside `routed()`, which `TorchExecutor(kernels="cuda")` enters around each of its forwards:
  the kernel ALWAYS runs there (no fallback: an input the kernel cannot take raises its TypeError /
  ValueError), and only that executor is affected; or
- `enable()` was called (process-wide, for experiments and tests): the kernel runs on CUDA tensors of
  a supported dtype, and the reference serves everything else (CPU tensors, FP8 activations, a cache
  dtype other than q's). `disable()` undoes `enable()`.

Everywhere else the dispatchers call the reference, so installing them changes nothing by itself.

The library is found at $PEAGLE_KERNELS_LIB, else plugins/build/libpeagle_kernels.so (built by
scripts/build_plugins.sh). Without it, or without a CUDA device, calls raise `KernelsUnavailable`.
How to test: tests/plugins/test_kernels_gpu.py (`pytest -m gpu`, every kernel against the reference);
tests/executors/test_kernels_option.py (the option's plumbing and errors, CPU).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import importlib
import os
import threading
from pathlib import Path

import torch

from peagle_trt.errors import ConfigError
from peagle_trt.ops import reference

ENV_LIB = "PEAGLE_KERNELS_LIB"
DEFAULT_LIB = Path(__file__).resolve().parents[2] / "plugins" / "build" / "libpeagle_kernels.so"
API_VERSION = 2  # peagle_kernels_version() of the C API declared below (2: paged KV cache)

# peagle_dtype_t of include/peagle_kernels.h
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_FP8 = getattr(torch, "float8_e4m3fn", None)
if _FP8 is not None:
    _DTYPES[_FP8] = 3
_ATTN_FORCE_SIMPLE = 1

_POISON_WORKSPACE = False  # tests: fill scratch buffers with NaN bytes before each call

_lib: ctypes.CDLL | None = None
_lock = threading.Lock()


class KernelsUnavailable(ConfigError):
    """libpeagle_kernels.so is missing / unloadable, or there is no CUDA device."""


def library_path() -> Path:
    """Where the kernel library is looked for ($PEAGLE_KERNELS_LIB first)."""
    env = os.environ.get(ENV_LIB)
    return Path(env) if env else DEFAULT_LIB


def load() -> ctypes.CDLL:
    """Load libpeagle_kernels.so once (no CUDA device needed for loading)."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = library_path()
        if not path.is_file():
            raise KernelsUnavailable(
                f"CUDA kernel library not found at {path}: build it with scripts/build_plugins.sh "
                f"(needs nvcc) or point ${ENV_LIB} at libpeagle_kernels.so")
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise KernelsUnavailable(f"cannot load {path}: {e}") from e
        _declare(lib)
        version = lib.peagle_kernels_version()
        if version != API_VERSION:
            raise KernelsUnavailable(
                f"{path} implements kernel API version {version}, this code calls version {API_VERSION} "
                "(the paged KV cache); rebuild it with scripts/build_plugins.sh")
        _lib = lib
        return lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i32, i64, f32, sz = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_size_t
    enum = ctypes.c_int
    lib.peagle_kv_attention.argtypes = [p] * 8 + [i32] * 8 + [f32] * 3 + [enum, enum, p, sz, i32, p]
    lib.peagle_kv_attention.restype = ctypes.c_int
    lib.peagle_kv_attention_workspace_size.argtypes = [i32, i32, i32, i32, i32]
    lib.peagle_kv_attention_workspace_size.restype = sz
    lib.peagle_draft_inputs.argtypes = [p] * 10 + [i32, i32, i32, i64, i32, i64, enum, p]
    lib.peagle_draft_inputs.restype = ctypes.c_int
    lib.peagle_draft_sample.argtypes = [p, p, p, i32, i64, enum, p, sz, p]
    lib.peagle_draft_sample.restype = ctypes.c_int
    lib.peagle_draft_sample_workspace_size.argtypes = [i32, i64]
    lib.peagle_draft_sample_workspace_size.restype = sz
    lib.peagle_error_string.argtypes = [enum]
    lib.peagle_error_string.restype = ctypes.c_char_p
    lib.peagle_kernels_version.argtypes = []
    lib.peagle_kernels_version.restype = i32


def available() -> bool:
    """True when a CUDA device is visible and the kernel library loads."""
    if not torch.cuda.is_available():
        return False
    try:
        load()
    except KernelsUnavailable:
        return False
    return True


# -- helpers --------------------------------------------------------------------------------------

def _cuda_lib(*tensors: torch.Tensor) -> ctypes.CDLL:
    if not torch.cuda.is_available():
        raise KernelsUnavailable("no CUDA device: the P-EAGLE kernels run on NVIDIA GPUs only "
                                 "(use peagle_trt.ops.reference on CPU)")
    lib = load()
    device = tensors[0].device
    for t in tensors:
        if t is not None and (t.device.type != "cuda" or t.device != device):
            raise ValueError(f"all tensors must be on the same CUDA device (got {t.device} and {device})")
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _dtype_code(t: torch.Tensor, what: str, allowed: tuple[int, ...] = (0, 1, 2)) -> int:
    code = _DTYPES.get(t.dtype)
    if code is None or code not in allowed:
        raise TypeError(f"{what}: unsupported dtype {t.dtype}")
    return code


def _check(lib: ctypes.CDLL, err: int, op: str) -> None:
    if err != 0:
        raise RuntimeError(f"{op}: CUDA error {err} ({lib.peagle_error_string(err).decode()})")


def _workspace(nbytes: int, device: torch.device) -> torch.Tensor | None:
    if nbytes == 0:
        return None
    if _POISON_WORKSPACE:
        return torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=device)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _out(out: torch.Tensor | None, shape, dtype, device, what: str) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if (tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device
            or not out.is_contiguous()):
        raise ValueError(f"{what}: out must be a contiguous {dtype} tensor of shape {tuple(shape)} "
                         f"on {device}")
    return out


def _i64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64).contiguous()


# -- the ops --------------------------------------------------------------------------------------

def kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 block_tables: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float | None = None, *, k_scale: float = 1.0,
                 v_scale: float = 1.0, out: torch.Tensor | None = None, simple: bool = False,
                 split: bool = True) -> torch.Tensor:
    """PEagleKVAttention on the GPU over a paged cache; see `reference.kv_attention`. Writes k/v into
    the caches in place.

    q [B, S, H*d], k/v [B, S, KV*d] (float32/float16/bfloat16, one dtype); positions [B, S] (-1 =
    padding); block_tables [B, M] (-1 = no block); k_cache/v_cache [N+1, bs, KV, d] contiguous (the
    last block is the trash block), q's dtype or float8_e4m3fn (then k_scale/v_scale are the
    per-tensor dequantization scales). Returns out [B, S, H*d]. One difference from the reference,
    outside the runtime's contract: a table entry -1 inside a row's visible range is masked here,
    where the reference reads the trash block.
    """
    lib = _cuda_lib(q, k, v, positions, block_tables, k_cache, v_cache)
    b, s, _ = q.shape
    if (q.shape[-1] != num_heads * head_dim or k.shape != (b, s, num_kv_heads * head_dim)
            or v.shape != k.shape):
        raise ValueError(f"kv_attention: q {tuple(q.shape)} / k {tuple(k.shape)} / v {tuple(v.shape)} do not "
                         f"match num_heads={num_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}")
    if positions.shape != (b, s) or block_tables.dim() != 2 or block_tables.shape[0] != b:
        raise ValueError(f"kv_attention: positions {tuple(positions.shape)} / block_tables "
                         f"{tuple(block_tables.shape)} must be [{b}, {s}] / [{b}, M]")
    if k_cache.dim() != 4:
        raise ValueError(f"kv_attention: caches must be [blocks + 1, block_size, kv_heads, head_dim], got "
                         f"{tuple(k_cache.shape)}")
    nb, bs, kvh, d = k_cache.shape
    if (kvh != num_kv_heads or d != head_dim or v_cache.shape != k_cache.shape
            or v_cache.dtype != k_cache.dtype):
        raise ValueError(f"kv_attention: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match")
    m = block_tables.shape[1]
    if m < 1 or m * bs >= 2 ** 31 or nb >= 2 ** 31:
        raise ValueError(f"kv_attention: {m} table entries of {bs} positions, {nb} blocks: out of range")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("kv_attention: the caches are updated in place and must be contiguous")
    act = _dtype_code(q, "kv_attention q")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError("kv_attention: q, k and v must share a dtype")
    cache = _dtype_code(k_cache, "kv_attention cache", (act, 3))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    positions, tables = _i64(positions), _i64(block_tables)
    out = _out(out, q.shape, q.dtype, q.device, "kv_attention")
    ws_bytes = lib.peagle_kv_attention_workspace_size(b, s, num_heads, head_dim, m * bs) if split else 0
    ws = _workspace(ws_bytes, q.device)
    with torch.cuda.device(q.device):
        stream = torch.cuda.current_stream(q.device).cuda_stream
        err = lib.peagle_kv_attention(
            _ptr(q), _ptr(k), _ptr(v), _ptr(positions), _ptr(tables), _ptr(k_cache), _ptr(v_cache), _ptr(out),
            b, s, num_heads, num_kv_heads, head_dim, nb, bs, m, float(scale or 0.0), float(k_scale),
            float(v_scale), act, cache, _ptr(ws), ws_bytes, _ATTN_FORCE_SIMPLE if simple else 0, stream)
    _check(lib, err, "kv_attention")
    return out


def draft_inputs(pending_tokens: torch.Tensor, pending_hidden: torch.Tensor, num_pending: torch.Tensor,
                 cur: torch.Tensor, embed_tokens: torch.Tensor, h_mask: torch.Tensor, num_spec_tokens: int,
                 mask_token_id: int, *, out: tuple[torch.Tensor, ...] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PEagleDraftInputs on the GPU; see `reference.draft_inputs`. embed_tokens must share
    pending_hidden's dtype (h_mask is cast). Returns embeds, hidden, positions, sample_rows."""
    lib = _cuda_lib(pending_tokens, pending_hidden, num_pending, cur, embed_tokens, h_mask)
    bsz, p = pending_tokens.shape
    hs = pending_hidden.shape[-1]
    if pending_hidden.shape != (bsz, p, hs) or embed_tokens.shape[-1] != hs or h_mask.shape != (hs,):
        raise ValueError("draft_inputs: inconsistent shapes")
    dtype = _dtype_code(pending_hidden, "draft_inputs hidden")
    if embed_tokens.dtype != pending_hidden.dtype:
        raise TypeError(f"draft_inputs: embed_tokens ({embed_tokens.dtype}) must share pending_hidden's "
                        f"dtype ({pending_hidden.dtype})")
    k = int(num_spec_tokens)
    r = p + k - 1
    dev = pending_hidden.device
    outs = out or (None, None, None, None)
    embeds = _out(outs[0], (bsz, r, hs), pending_hidden.dtype, dev, "draft_inputs embeds")
    hidden = _out(outs[1], (bsz, r, hs), pending_hidden.dtype, dev, "draft_inputs hidden")
    positions = _out(outs[2], (bsz, r), torch.int64, dev, "draft_inputs positions")
    sample_rows = _out(outs[3], (bsz, k), torch.int64, dev, "draft_inputs sample_rows")
    tokens, hid = _i64(pending_tokens), pending_hidden.contiguous()
    n, c = _i64(num_pending), _i64(cur)
    emb, hm = embed_tokens.contiguous(), h_mask.to(pending_hidden.dtype).contiguous()
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev).cuda_stream
        err = lib.peagle_draft_inputs(
            _ptr(tokens), _ptr(hid), _ptr(n), _ptr(c), _ptr(emb), _ptr(hm), _ptr(embeds), _ptr(hidden),
            _ptr(positions), _ptr(sample_rows), bsz, p, hs, emb.shape[0], k, int(mask_token_id), dtype,
            stream)
    _check(lib, err, "draft_inputs")
    return embeds, hidden, positions, sample_rows


def draft_sample(logits: torch.Tensor, d2t: torch.Tensor | None, *, out: torch.Tensor | None = None,
                 split: bool = True) -> torch.Tensor:
    """PEagleDraftSample on the GPU; see `reference.draft_sample`. logits [..., V_d] -> ids [...]."""
    lib = _cuda_lib(logits, *(() if d2t is None else (d2t,)))
    vocab = logits.shape[-1]
    rows = logits.numel() // vocab if vocab else 0
    dtype = _dtype_code(logits, "draft_sample logits")
    x = logits.contiguous()
    table = None if d2t is None else _i64(d2t)
    if table is not None and table.numel() != vocab:
        raise ValueError(f"draft_sample: d2t has {table.numel()} entries for a vocabulary of {vocab}")
    ids = _out(out, logits.shape[:-1], torch.int64, logits.device, "draft_sample")
    ws_bytes = lib.peagle_draft_sample_workspace_size(rows, vocab) if split else 0
    ws = _workspace(ws_bytes, logits.device)
    with torch.cuda.device(logits.device):
        stream = torch.cuda.current_stream(logits.device).cuda_stream
        err = lib.peagle_draft_sample(_ptr(x), _ptr(table), _ptr(ids), rows, vocab, dtype, _ptr(ws), ws_bytes,
                                      stream)
    _check(lib, err, "draft_sample")
    return ids


# -- routing the torch executor through the kernels -----------------------------------------------

_ROUTED = contextvars.ContextVar("peagle_kernels_routed", default=False)  # inside routed()
_GLOBAL = False  # enable() was called


def _use_kernel(supported: bool) -> bool:
    if _ROUTED.get():
        return True  # kernels="cuda": always the kernel; it raises on what it cannot take
    return _GLOBAL and supported and available()


def _kv_attention_dispatch(q, k, v, positions, block_tables, k_cache, v_cache, num_heads, num_kv_heads,
                           head_dim, scale=None):
    supported = (q.is_cuda and k_cache.is_cuda and q.dtype in _DTYPES and q.dtype != _FP8
                 and k_cache.dtype == q.dtype and k_cache.is_contiguous() and v_cache.is_contiguous())
    op = kv_attention if _use_kernel(supported) else reference.kv_attention
    return op(q, k, v, positions, block_tables, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale)


def _draft_inputs_dispatch(pending_tokens, pending_hidden, num_pending, cur, embed_tokens, h_mask,
                           num_spec_tokens, mask_token_id):
    supported = (pending_hidden.is_cuda and embed_tokens.is_cuda and embed_tokens.dtype == pending_hidden.dtype
                 and pending_hidden.dtype in (torch.float32, torch.float16, torch.bfloat16))
    op = draft_inputs if _use_kernel(supported) else reference.draft_inputs
    return op(pending_tokens, pending_hidden, num_pending, cur, embed_tokens, h_mask, num_spec_tokens,
              mask_token_id)


def _draft_sample_dispatch(logits, d2t):
    supported = logits.is_cuda and logits.dtype in (torch.float32, torch.float16, torch.bfloat16)
    op = draft_sample if _use_kernel(supported) else reference.draft_sample
    return op(logits, d2t)


_PATCHES = (("peagle_trt.models.layers", "kv_attention", _kv_attention_dispatch),
            ("peagle_trt.executors.torch", "draft_inputs", _draft_inputs_dispatch),
            ("peagle_trt.executors.torch", "draft_sample", _draft_sample_dispatch))
_saved: dict[tuple[str, str], object] = {}


def install() -> None:
    """Swap the models' op names for the dispatchers (idempotent; alone, it changes no result)."""
    with _lock:
        for module, name, fn in _PATCHES:
            mod = importlib.import_module(module)
            if getattr(mod, name) is not fn:
                _saved.setdefault((module, name), getattr(mod, name))
                setattr(mod, name, fn)


def require(device: torch.device) -> None:
    """Raise KernelsUnavailable unless the kernels can run on `device` (a CUDA device, library loaded)."""
    device = torch.device(device)
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
    CUDA kernels, with no fallback. Used by `TorchExecutor(kernels="cuda")` around its forwards."""
    install()
    token = _ROUTED.set(True)
    try:
        yield
    finally:
        _ROUTED.reset(token)


def enable() -> None:
    """Route every CUDA call of the ops through the kernels, process-wide (CUDA tensors of supported
    dtypes only; the reference keeps serving the rest). Raises KernelsUnavailable if the library or
    the GPU is missing."""
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
