"""The fused MoE kernel (peagle_trt/ops/triton_kernels/moe.py) against `reference.moe`, under the Triton
interpreter on CPU (`-m kernels`; on a GPU: PEAGLE_TRITON_DEVICE=cuda pytest tests/ops/test_moe_kernel.py).

Cases: every family's routing and activation (Qwen3-MoE softmax-top-k renormalised + SiLU, GPT-OSS
top-k-softmax + biases + clamped SwiGLU (limit lowered so the clamps bite), Gemma-4 GELU-tanh + per-expert
scale), every weight kind (fp32, bf16, fp16; FP8 per tensor, per channel, 128 x 128 blocks), decode (T = 1),
verify (8), tree (12) and prefill (40: past 16 rows per expert, the "large" tiles) rows, with rows routed
at random, all to the same experts, to every expert, and half the experts routed to by no row. Sizes
are tiny and chosen to leave partial tiles (H = 48, I = 40; block FP8: H = 160, I = 128). The routing
and the alignment are also checked exactly on their own; the whole path for host reads (none) and for
a row's independence of the other rows (bit-equal).

Tolerance: |kernel - reference| <= TOL * max |reference| per case. Both sum float32 products in
different orders, so h (rounded once to x's dtype) can land one ulp apart and then feed the down
projection: fp32 1e-5 (float32 rounding of sums of ~100 terms); fp16 2e-3 and bf16 1.6e-2 (about two
ulps of the output's dtype at the largest value: its own rounding plus a flipped h). FP8 with 16-bit
activations 2.5e-2: a flipped h may also flip its E4M3 code (1/16 of one of I inputs of the down GEMM);
with fp32 activations h is not rounded, codes agree and 1e-5 holds. A wrong scale, expert or row
is off by O(1) of max |reference|.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.ops.conftest import DEVICE, rowwise_dot  # sets TRITON_INTERPRET=1 on CPU, before the kernels are imported

triton = pytest.importorskip("triton", reason="pip install -c constraints.txt 'peagle-trt[dev]' (triton==3.9.0)")

from peagle_trt.errors import ConfigError, OpInputError  # noqa: E402
from peagle_trt.ops import kernels, reference  # noqa: E402
from peagle_trt.ops.triton_kernels import moe as mk  # noqa: E402

pytestmark = pytest.mark.kernels
FP8 = torch.float8_e4m3fn
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
FP8_TOL = 2.5e-2
FAMILIES = {
    "qwen3": dict(routing="softmax_topk", renormalize=True, activation="silu"),
    "gpt_oss": dict(routing="topk_softmax", activation="clamped_swiglu", swiglu_alpha=1.702, swiglu_limit=1.5),
    "gemma4": dict(routing="softmax_topk", renormalize=True, activation="gelu_tanh"),
}


def make_case(family: str, weights: str, dtype: torch.dtype, t: int, routed: str, experts: int = 8, k: int = 2,
              seed: int = 0) -> tuple[tuple, dict]:
    """(args, kwargs) of one `moe` call. weights: fp32 / bf16 / fp16 (= dtype) or fp8-tensor / -channel /
    -block, or fp8-channel-static (per-channel weight scales, static activation scales: ModelOpt's
    experts stacked); routed: random, same (every row to the same k experts), every (row t's first pick t % E),
    empty (experts E/2.. never picked)."""
    gen = torch.Generator().manual_seed(seed)
    kind = weights[4:] if weights.startswith("fp8") else "none"
    static = kind.endswith("-static")
    kind = kind.removesuffix("-static")
    h, i = (160, 128) if kind == "block" else (48, 40)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    x = rand(t, h).to(dtype)
    logits = rand(t, experts)
    if routed == "same":
        logits[:, [experts - 1, 2]] += 30.0
    elif routed == "every":
        logits[torch.arange(t), torch.arange(t) % experts] += 30.0
    elif routed == "empty":
        logits[:, experts // 2:] -= 30.0
    s13 = s2 = a13 = a2 = None
    if kind == "none":
        w13, w2 = (rand(experts, 2 * i, h) * h ** -0.5).to(dtype), (rand(experts, h, i) * i ** -0.5).to(dtype)
    else:
        w13, w2 = ((rand(experts, 2 * i, h) * 64).clamp(-448, 448).to(FP8),
                   (rand(experts, h, i) * 64).clamp(-448, 448).to(FP8))
        shapes = {"tensor": ((experts,), (experts,)), "channel": ((experts, 2 * i), (experts, h)),
                  "block": ((experts, 2 * i // 128, -(-h // 128)), (experts, -(-h // 128), i // 128))}[kind]
        s13 = (torch.rand(*shapes[0], generator=gen) + 0.5) * h ** -0.5 / 64
        s2 = (torch.rand(*shapes[1], generator=gen) + 0.5) * i ** -0.5 / 64
        if kind == "tensor" or static:  # static input scales: some activations clamp at +-448
            a13 = (torch.rand(experts, generator=gen) + 0.5) * 3 / 448
            a2 = (torch.rand(experts, generator=gen) + 0.5) / 448
    b13 = b2 = scale = None
    if family == "gpt_oss":
        b13, b2 = rand(experts, 2 * i).to(dtype), rand(experts, h).to(dtype)
    if family == "gemma4":
        scale = torch.rand(experts, generator=gen) + 0.5
    kwargs = dict(FAMILIES[family], top_k=k)
    return (x, logits, w13, w2, b13, b2, scale, s13, s2, a13, a2), kwargs


def on_device(args: tuple) -> tuple:
    return tuple(None if a is None else a.to(DEVICE) for a in args)


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    got, want = got.cpu().double(), want.double()
    assert torch.isfinite(got).all()
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err <= tol, f"max |kernel - reference| = {err:.3g} x max |reference| > {tol}"


CASES = [  # (family, weights, act dtype, rows, routed)
    ("qwen3", "bf16", torch.bfloat16, 1, "random"),
    ("qwen3", "fp8-block", torch.bfloat16, 1, "random"),
    ("qwen3", "fp8-block", torch.bfloat16, 8, "every"),
    ("qwen3", "fp32", torch.float32, 12, "same"),
    ("qwen3", "fp8-channel", torch.float16, 40, "empty"),
    ("gpt_oss", "bf16", torch.bfloat16, 8, "every"),
    ("gpt_oss", "fp16", torch.float16, 12, "random"),
    ("gpt_oss", "fp32", torch.float32, 40, "empty"),
    ("gpt_oss", "fp8-tensor", torch.bfloat16, 8, "same"),
    ("gpt_oss", "fp8-block", torch.float32, 12, "random"),
    ("gemma4", "fp16", torch.float16, 1, "random"),
    ("gemma4", "fp8-tensor", torch.float16, 12, "every"),
    ("gemma4", "fp8-channel", torch.bfloat16, 8, "same"),
    ("gemma4", "bf16", torch.bfloat16, 40, "same"),
    ("gemma4", "fp8-channel", torch.float32, 1, "random"),
    ("qwen3", "fp8-channel-static", torch.float32, 8, "random"),
]


@pytest.mark.parametrize("family,weights,dtype,rows,routed", CASES,
                         ids=[f"{f}-{w}-{str(d)[6:]}-T{t}-{r}" for f, w, d, t, r in CASES])
def test_moe_matches_the_reference(family, weights, dtype, rows, routed):
    experts = 4 if rows == 40 else 8  # T * k = 80 > 16 E at prefill: the "large" tiles
    args, kw = make_case(family, weights, dtype, rows, routed, experts=experts, seed=rows)
    if rows == 40:
        assert mk.choose_tiles(rows, 2, experts, dtype, "none").block_m > 16
    out = torch.full((rows, args[0].shape[1]), float("nan"), dtype=dtype, device=DEVICE)
    got = mk.moe(*on_device(args), **kw, out=out)
    assert got.data_ptr() == out.data_ptr()
    tol = FP8_TOL if weights.startswith("fp8") and dtype != torch.float32 else TOL[dtype]
    assert_close(got, reference.moe(*args, **kw), tol)


def test_moe_with_twenty_experts_and_three_picks():
    """E and k that are no powers of two (the routing's and alignment's padded lanes), every row's picks
    spread over most experts."""
    args, kw = make_case("gemma4", "fp8-block", torch.float32, 12, "random", experts=20, k=3, seed=4)
    assert_close(mk.moe(*on_device(args), **kw), reference.moe(*args, **kw), TOL[torch.float32])


@pytest.mark.parametrize("tiles", [mk.MoETiles(32, 32, 64, 4, 2), mk.MoETiles(64, 128, 32, 8, 1)])
def test_forced_tiles_give_the_same_result(tiles):
    args, kw = make_case("gpt_oss", "bf16", torch.bfloat16, 12, "random", seed=3)
    assert_close(mk.moe(*on_device(args), **kw, config=tiles), reference.moe(*args, **kw), TOL[torch.bfloat16])
    block, _ = make_case("qwen3", "fp8-block", torch.bfloat16, 2, "random")
    with pytest.raises(ConfigError, match="block_k = 128"):
        mk.moe(*on_device(block), **kw, config=tiles)


@pytest.mark.parametrize("routing", ["softmax_topk", "topk_softmax"])
def test_routing_picks_the_reference_experts_in_its_order(routing):
    """Ties go to the lower expert id, in the kernel and the reference alike (-inf and equal rows too)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 20, generator=gen)
    logits[0, [3, 11, 17]] = 4.0  # a three-way tie at the top
    logits[1] = 0.5  # every expert equal
    logits[2, :18] = float("-inf")  # fewer finite logits than picks
    logits[3, [0, 19]] = logits[3].max() + 1  # tie at both ends
    scale = torch.rand(20, generator=gen) + 0.5
    for renormalize, expert_scale in ((False, None), (True, scale)):
        w, ids = mk.route(logits.bfloat16().to(DEVICE), 4, routing, renormalize,
                          None if expert_scale is None else expert_scale.to(DEVICE))
        want_w, want_ids = reference.moe_route(logits.bfloat16(), 4, routing, renormalize, expert_scale)
        assert torch.equal(ids.cpu().long(), want_ids)
        assert ids[0, :3].tolist() == [3, 11, 17] and ids[1].tolist() == [0, 1, 2, 3]
        finite = torch.isfinite(want_w)
        assert torch.equal(torch.isfinite(w.cpu()), finite)
        torch.testing.assert_close(w.cpu()[finite], want_w[finite], rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("experts,block_m,ids", [
    (8, 16, [5]),  # decode: one pair
    (8, 16, [3] * 13),  # every pair to one expert, a partial block
    (4, 16, list(range(4)) * 9),  # every expert, 9 pairs each
    (16, 16, [1, 1, 14, 1, 7, 14, 7, 7, 7] * 4),  # most experts empty
    (128, 16, [(p * 37) % 128 for p in range(200)]),  # 128 experts, several chunks of pairs
    (4, 64, [2, 0, 2, 2, 0]),
])
def test_align_groups_pairs_by_expert_and_pads_each_group(experts, block_m, ids):
    sorted_ids, block_expert, total = mk.align(torch.tensor(ids, dtype=torch.int32, device=DEVICE), experts,
                                               block_m)
    sorted_ids, block_expert, total = sorted_ids.cpu(), block_expert.cpu(), int(total.cpu()[0])
    p = len(ids)
    assert sorted_ids.numel() == mk.slots_for(p, experts, block_m)  # shape-only bound
    want, want_experts = [], []
    for e in range(experts):  # each group: its pairs in pair order, padded with the sentinel p
        group = [q for q in range(p) if ids[q] == e]
        padded = -(-len(group) // block_m) * block_m
        want += group + [p] * (padded - len(group))
        want_experts += [e] * (padded // block_m)
    assert total == len(want) <= sorted_ids.numel()
    assert sorted_ids[:total].tolist() == want
    blocks = total // block_m
    assert block_expert[:blocks].tolist() == want_experts
    assert (block_expert[blocks:] == -1).all()


def test_a_rows_output_does_not_depend_on_the_other_rows(monkeypatch):
    """Bit-equal rows alone, in a batch of 40 (the large tiles), and with other rows around them, given
    a dot whose element depends on its own row and column only (the GPU's MMA: `rowwise_dot`; on a GPU
    the compiled kernel itself)."""
    if DEVICE == "cpu":
        rowwise_dot(monkeypatch)
    _check_rows_alone_equal_rows_in_a_batch()


@pytest.mark.skipif(DEVICE != "cpu", reason="replaces the interpreter's tl.dot")
def test_the_row_check_sees_a_row_dependent_dot(monkeypatch):
    """The check above is no weaker on `rowwise_dot`: with a dot that sums a tile's rows 1 and up in
    another order (a pair sits lower in its expert's block in the batch than alone), it fails."""
    rowwise_dot(monkeypatch, tail_reversed_from=1)
    with pytest.raises(AssertionError, match="fp32"):
        _check_rows_alone_equal_rows_in_a_batch()


def _check_rows_alone_equal_rows_in_a_batch():
    # float32 activations: every bit of the GEMMs' sums reaches the output (bf16 would round most away)
    for weights, dtype in (("fp32", torch.float32), ("fp8-block", torch.float32)):
        args, kw = make_case("qwen3", weights, dtype, 40, "random", experts=4, seed=7)
        args = on_device(args)
        full = mk.moe(*args, **kw)
        for rows in ([0], [17, 3], list(range(10, 30))):
            part = mk.moe(args[0][rows], args[1][rows], *args[2:], **kw)
            assert torch.equal(part, full[rows]), (weights, rows)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_the_kernel_path_reads_nothing_back_to_the_host(monkeypatch):
    """No .item() / .tolist() / .cpu() / .numpy() / bool() from peagle_trt's code, and no aten op with a
    data-dependent result (nonzero, masked_select, a scalar read) anywhere in the call."""
    calls = []
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        original = getattr(torch.Tensor, name)

        def spy(self, *a, _name=name, _original=original, **k):
            caller = sys._getframe(1).f_code.co_filename
            if "peagle_trt" in caller:
                calls.append((_name, caller))
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    args, kw = make_case("qwen3", "fp8-block", torch.bfloat16, 8, "random")
    args = on_device(args)
    with _Recorder() as rec:
        kernels_out = mk.moe(*args, **kw)
        with kernels.rehearsal():
            kernels.moe(*args, **kw)
    monkeypatch.undo()
    assert calls == []
    reads = {op for op in rec.ops if any(s in op for s in ("_local_scalar_dense", "nonzero", "masked_select",
                                                            "is_nonzero", "unique", "equal"))}
    assert reads == set(), reads
    assert torch.isfinite(kernels_out.cpu()).all()


def test_the_dispatcher_replaces_fused_moe_and_runs_the_kernel_when_routed():
    from peagle_trt.models import moe as models_moe

    kernels.disable()  # from the names' own functions (an earlier test's routed() may have installed)
    assert models_moe.fused_moe is reference.moe
    args, kw = make_case("gemma4", "bf16", torch.bfloat16, 3, "random")
    try:
        kernels.install()
        assert models_moe.fused_moe is kernels._moe_dispatch
        want = models_moe.fused_moe(*args, **kw)  # not routed: the reference
        assert torch.equal(want, reference.moe(*args, **kw))
        if DEVICE == "cpu":
            with kernels.rehearsal(), kernels.routed():
                got = models_moe.fused_moe(*args, **kw)
            assert_close(got, want, TOL[torch.bfloat16])
    finally:
        kernels.disable()
    assert models_moe.fused_moe is reference.moe


def test_the_reference_refuses_bad_arguments():
    args, kw = make_case("qwen3", "fp8-tensor", torch.bfloat16, 2, "random")
    x, logits, w13, w2, b13, b2, scale, s13, s2, a13, a2 = args
    cases = [  # (what changes, message)
        (dict(w2=w2.to(torch.bfloat16)), "w13 / w2 must be both x's dtype"),
        (dict(a13=None), "a13_scale / a2_scale must be float32"),
        (dict(s13=s13[:, None].expand(-1, 80).contiguous()), "w2_scale must be the kind of w13_scale"),
        (dict(s13=s13[:3]), "an FP8 weight scale must be float32"),
        (dict(logits=logits[:1]), r"router_logits must be a float tensor \[2, E\]"),
        (dict(w2=w2[:, :, :8]), "w2 must be"),
        (dict(scale=torch.ones(8, dtype=torch.float64)), "expert_scale must be float32"),
        (dict(top_k=9), "top_k must be an int in 1..8"),
        (dict(routing="sigmoid"), "routing / activation must be one of"),
    ]
    names = ("x", "logits", "w13", "w2", "b13", "b2", "scale", "s13", "s2", "a13", "a2")
    for change, message in cases:
        values = dict(zip(names, args), **{n: v for n, v in change.items() if n in names})
        call = dict(kw, **{n: v for n, v in change.items() if n not in names})
        with pytest.raises(OpInputError, match=message):
            reference.moe(*(values[n] for n in names), **call)
    block, kw = make_case("qwen3", "fp8-block", torch.bfloat16, 2, "random")
    with pytest.raises(OpInputError, match="None with block scales"):
        reference.moe(*block[:9], torch.ones(8), torch.ones(8), **kw)
    channel, kw = make_case("qwen3", "fp8-channel", torch.bfloat16, 2, "random")
    with pytest.raises(OpInputError, match="float32 .8. each"):  # static: both scales
        reference.moe(*channel[:9], torch.ones(8), None, **kw)
    plain, kw = make_case("qwen3", "bf16", torch.bfloat16, 2, "random")
    with pytest.raises(OpInputError, match="None for unquantized weights"):
        reference.moe(*plain[:7], torch.ones(8), **kw)
    with pytest.raises(OpInputError, match="moe: .*routing"):  # the kernel validates the same way
        mk.moe(*on_device(plain), **dict(kw, routing="nope"))
