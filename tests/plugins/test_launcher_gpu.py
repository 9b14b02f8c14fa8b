"""The plugin library's own path on a GPU: the C API of libpeagle_kernels.so (the hand-written
launcher, plugins/src/launcher/tritonLauncher.cpp) launching the embedded sm_90a / sm_100a cubins,
against the CPU references (PEagleMoE included: peagle_moe). This is what the TensorRT plugins'
enqueue calls; TensorRT itself is not needed. Build first: scripts/build_plugins.sh (scripts/gpu_validate.sh
does), for this GPU's architecture (an `a` cubin runs only on its exact compute capability)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

from peagle_trt.ops import reference
from tests.plugins.conftest import DEFAULT_BUILD_DIR

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    path = Path(os.environ.get("PEAGLE_PLUGINS_BUILD_DIR", DEFAULT_BUILD_DIR)) / "libpeagle_kernels.so"
    if not path.is_file():
        pytest.fail(f"{path} is missing: build it with scripts/build_plugins.sh")
    lib = ctypes.CDLL(str(path))
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
    lib.peagle_kv_attention.argtypes = [p] * 8 + [i32] * 8 + [f32] * 3 + [ctypes.c_int] * 2 + [p, ctypes.c_size_t,
                                                                                           i32, p]
    lib.peagle_draft_inputs.argtypes = [p] * 10 + [i32, i32, i32, i64, i32, i64, ctypes.c_int, p]
    lib.peagle_draft_sample.argtypes = [p, p, p, i32, i64, ctypes.c_int, p, ctypes.c_size_t, p]
    lib.peagle_moe.argtypes = [p] * 12 + [i32] * 8 + [f32] * 2 + [ctypes.c_int] * 3 + [p, ctypes.c_size_t, p]
    lib.peagle_moe_workspace_size.restype = ctypes.c_size_t
    lib.peagle_moe_workspace_size.argtypes = [i32] * 5 + [ctypes.c_int] * 2
    lib.peagle_error_string.restype = ctypes.c_char_p
    return lib


def check(lib, err: int) -> None:
    torch.cuda.synchronize()
    assert err == 0, lib.peagle_error_string(err).decode()


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_sample_cubin(lib, dtype):
    logits = torch.randn(6, 32000).to(dtype)
    logits[2, [5, 31000]] = 40.0  # a tie: the lower index wins
    d2t = torch.randint(0, 9, (32000,))
    lg, table = logits.cuda(), d2t.cuda()
    ids = torch.full((6,), -1, dtype=torch.int64, device="cuda")
    check(lib, lib.peagle_draft_sample(lg.data_ptr(), table.data_ptr(), ids.data_ptr(), 6, 32000, DTYPE_CODE[dtype],
                                       None, 0, stream()))
    assert torch.equal(ids.cpu(), reference.draft_sample(logits, d2t))


def test_draft_inputs_cubin(lib):
    b, p, h, v, k = 3, 4, 96, 50, 5
    tokens, hidden = torch.randint(0, v, (b, p)), torch.randn(b, p, h).half()
    n, cur = torch.tensor([1, 4, 2]), torch.tensor([5, 30, 9])
    embed, h_mask = torch.randn(v, h).half(), torch.randn(h).half()
    r = p + k - 1
    ins = [x.cuda() for x in (tokens, hidden, n, cur, embed, h_mask)]
    outs = [torch.full((b, r, h), float("nan"), dtype=torch.half, device="cuda"),
            torch.full((b, r, h), float("nan"), dtype=torch.half, device="cuda"),
            torch.full((b, r), -7, device="cuda"), torch.full((b, k), -7, device="cuda")]
    check(lib, lib.peagle_draft_inputs(*(x.data_ptr() for x in ins + outs), b, p, h, v, k, 7, 1, stream()))
    for got, want in zip(outs, reference.draft_inputs(tokens, hidden, n, cur, embed, h_mask, k, 7)):
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 256)])
def test_kv_attention_cubin(lib, dtype, d):
    h, kv, bs = 8, 2, 16
    positions = torch.tensor([[40, 41, 42, 43], [7, 8, -1, -1]])
    tables = torch.tensor([[0, 1, 2, -1], [3, -1, -1, -1]])
    blocks = 5  # + the trash block
    q = torch.randn(2, 4, h * d).to(dtype)
    k, v = torch.randn(2, 4, kv * d).to(dtype), torch.randn(2, 4, kv * d).to(dtype)
    kc, vc = torch.randn(blocks + 1, bs, kv, d).to(dtype), torch.randn(blocks + 1, bs, kv, d).to(dtype)
    dev = [x.cuda() for x in (q, k, v, positions, tables, kc, vc)]
    out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
    code = DTYPE_CODE[dtype]
    check(lib, lib.peagle_kv_attention(*(x.data_ptr() for x in dev), out.data_ptr(), 2, 4, h, kv, d, blocks + 1, bs,
                                       4, 0.0, 1.0, 1.0, code, code, None, 0, 0, stream()))
    kc_ref, vc_ref = kc.float(), vc.float()
    want = reference.kv_attention(q.float(), k.float(), v.float(), positions, tables, kc_ref, vc_ref, h, kv, d)
    live = positions >= 0
    tol = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.float().cpu()[live], want[live], atol=tol, rtol=tol)
    assert torch.equal(dev[5].float().cpu()[:-1], kc_ref[:-1])  # the writes (trash block aside)


MOE_KINDS = {"none": 0, "tensor": 1, "channel": 2, "block": 3}


@pytest.mark.parametrize("dtype,kind,rows", [(torch.bfloat16, "block", 1), (torch.bfloat16, "block", 40),
                                             (torch.float16, "tensor", 8), (torch.bfloat16, "channel", 12),
                                             (torch.bfloat16, "none", 8), (torch.float32, "none", 40)])
def test_moe_cubin(lib, dtype, kind, rows):
    """peagle_moe (routing, alignment, grouped GEMMs, sum from the embedded cubins, at both tile regimes)
    against reference.moe; GPT-OSS's routing, biases and clamped SwiGLU for unquantized weights, Qwen3's
    softmax-top-k with FP8. Tolerances as tests/ops/test_moe_kernel.py."""
    gen = torch.Generator().manual_seed(rows)
    e, k, h, i = 8, 2, 256, 128  # H and I multiples of every K step (the ALIGNED variants)
    x, logits = torch.randn(rows, h, generator=gen).to(dtype), torch.randn(rows, e, generator=gen)
    fp8 = kind != "none"
    s13 = s2 = a13 = a2 = b13 = b2 = None
    if fp8:
        w13 = (torch.randn(e, 2 * i, h, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        w2 = (torch.randn(e, h, i, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        shapes = {"tensor": ((e,), (e,)), "channel": ((e, 2 * i), (e, h)),
                  "block": ((e, 2 * i // 128, h // 128), (e, h // 128, i // 128))}[kind]
        s13 = (torch.rand(*shapes[0], generator=gen) + 0.5) * h ** -0.5 / 64
        s2 = (torch.rand(*shapes[1], generator=gen) + 0.5) * i ** -0.5 / 64
        if kind == "tensor":
            a13, a2 = torch.full((e,), 3 / 448), torch.full((e,), 1 / 448)
        kw = dict(top_k=k, routing="softmax_topk", renormalize=True, activation="silu")
    else:
        w13 = (torch.randn(e, 2 * i, h, generator=gen) * h ** -0.5).to(dtype)
        w2 = (torch.randn(e, h, i, generator=gen) * i ** -0.5).to(dtype)
        b13, b2 = torch.randn(e, 2 * i, generator=gen).to(dtype), torch.randn(e, h, generator=gen).to(dtype)
        kw = dict(top_k=k, routing="topk_softmax", activation="clamped_swiglu", swiglu_limit=1.5)
    args = (x, logits, w13, w2, b13, b2, None, s13, s2, a13, a2)
    want = reference.moe(*args, **kw)
    dev = [None if t is None else t.cuda() for t in args]
    y = torch.full((rows, h), float("nan"), dtype=dtype, device="cuda")
    code = DTYPE_CODE[dtype]
    size = lib.peagle_moe_workspace_size(rows, h, e, i, k, code, MOE_KINDS[kind])
    assert size > 0
    ws = torch.empty(size, dtype=torch.uint8, device="cuda")
    ptrs = [0 if t is None else t.data_ptr() for t in dev]
    check(lib, lib.peagle_moe(*ptrs, y.data_ptr(), rows, h, e, i, k, ["softmax_topk", "topk_softmax"].index(
        kw["routing"]), int(kw.get("renormalize", False)), ["silu", "gelu_tanh", "clamped_swiglu"].index(
        kw["activation"]), 1.702, kw.get("swiglu_limit", 7.0), code, DTYPE_CODE[torch.float32], MOE_KINDS[kind],
        ws.data_ptr(), size, stream()))
    tol = 2.5e-2 if fp8 else {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    err = (y.double().cpu() - want.double()).abs().max().item() / want.double().abs().max().item()
    assert err <= tol, f"max |cubin - reference| = {err:.3g} x max |reference|"
