"""The Triton kernels on a GPU (JIT, through peagle_trt.ops.kernels) against the CPU reference
(peagle_trt.ops.reference), at sizes the interpreter tests (tests/ops/test_triton_kernels.py) cannot reach.

Fresh random inputs on every run (the seed is printed and kept in the test report; set
PEAGLE_TEST_SEED to replay one). Every output buffer is poisoned first (NaN / sentinel), so an
element a kernel forgets to write fails.

Covered: ragged batches (per-request context lengths 0..8k; at 8k unsplit, split by shape and in
7 segments; real rows + padding rows, rows in any order), rows S = K+1 for K in {1, 3, 7, 11, 15}
and prefill chunks (S up to 300), GQA groups 1..8,
head_dim 8..128, fp32 / fp16 / bf16 activations and caches, an FP8 (E4M3) cache against the reference
run on the dequantized cache, the paged cache (block sizes 16 / 32 and 1 / 24 / 64, each request's
blocks a random draw from a shuffled pool, -1 past its end; rows past the table write the trash
block), in-place KV writes (every cache element but the trash block compared, blocks of no table
untouched); the draft-input layout for fp32/fp16/bf16 and odd hidden sizes; argmax ties (lowest
index, across chunk boundaries), NaN and -inf rows, d2t; and the torch executor routed through the
kernels (`plugins.enable()`). Padding rows are not compared (the kernel returns zeros there, the
reference some finite row).
"""

from __future__ import annotations

import os

import pytest
import torch

from peagle_trt.ops import reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
FP8 = getattr(torch, "float8_e4m3fn", None)
TOL = {torch.float16: dict(atol=3e-3, rtol=3e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float32: dict(atol=2e-5, rtol=2e-5)}
CONTEXTS = [0, 1, 5, 63, 64, 65, 255, 256, 257, 1000, 4095, 8000]


@pytest.fixture(scope="module")
def pl():
    """peagle_trt.ops.kernels (the Triton kernels, JIT-compiled on this GPU)."""
    from peagle_trt.ops import kernels as plugins

    try:
        plugins.load()
    except plugins.KernelsUnavailable as e:
        pytest.fail(f"GPU present but the Triton kernels are unavailable: {e}")
    return plugins


@pytest.fixture
def gen(request):
    seed = int(os.environ.get("PEAGLE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)  # gen.initial_seed() recalls it in messages


def rand_int(gen, lo, hi):  # lo..hi inclusive
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


# ---- PEagleKVAttention ---------------------------------------------------------------------------

def make_tables(gen, lengths, m, block_size, spare=3):
    """Block tables [B, M] for requests of `lengths` positions: each takes ceil(length / bs) blocks
    (at most M) drawn from a shuffled pool, so consecutive entries are scattered; -1 past its end;
    `spare` blocks belong to no request. Returns (tables, number of blocks without the trash block)."""
    need = [min(-(-n // block_size), m) for n in lengths]
    total = sum(need) + spare
    pool = torch.randperm(total, generator=gen)
    tables = torch.full((len(lengths), m), -1, dtype=torch.int64)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = pool[at:at + n]
        at += n
    return tables, total


def make_batch(gen, b, s, h, kv, d, contexts, max_len=None, block_size=None, shuffle=True, full=False,
               spare=3):
    """A ragged batch: request i has n_i real rows at positions ctx_i .. ctx_i + n_i - 1, the other
    s - n_i rows are padding (-1); rows shuffled within the request. The cache is paged: M =
    ceil(max_len / bs) table entries per request (bs 16 or 32 unless given), blocks from make_tables,
    plus the trash block. CPU float32 tensors: q, k, v, positions, block_tables, k_cache, v_cache."""
    n_real = [s if full else rand_int(gen, 1, s) for _ in range(b)]
    positions = torch.full((b, s), -1, dtype=torch.int64)
    for i, (ctx, n) in enumerate(zip(contexts, n_real)):
        row = torch.cat([torch.arange(ctx, ctx + n), torch.full((s - n,), -1)])
        positions[i] = row[torch.randperm(s, generator=gen)] if shuffle else row
    block_size = block_size or (16, 32)[rand_int(gen, 0, 1)]
    max_len = max_len or max(contexts) + s + 1
    m = -(-max_len // block_size)
    tables, blocks = make_tables(gen, [ctx + n for ctx, n in zip(contexts, n_real)], m, block_size, spare)
    q = torch.randn(b, s, h * d, generator=gen)
    k = torch.randn(b, s, kv * d, generator=gen)
    v = torch.randn(b, s, kv * d, generator=gen)
    k_cache = torch.randn(blocks + 1, block_size, kv, d, generator=gen)  # stale contents everywhere
    v_cache = torch.randn(blocks + 1, block_size, kv, d, generator=gen)
    return q, k, v, positions, tables, k_cache, v_cache


def check_attention(pl, gen, dtype, q, k, v, positions, tables, k_cache, v_cache, h, kv, d, **kw):
    """Run the kernel (poisoned output) and the fp32 CPU reference on the same (rounded) inputs."""
    qd, kd, vd = (x.to(dtype) for x in (q, k, v))
    kc, vc = k_cache.to(dtype), v_cache.to(dtype)
    kc_gpu, vc_gpu = kc.to(CUDA), vc.to(CUDA)
    ptr = kc_gpu.data_ptr()
    out = torch.full(qd.shape, float("nan"), dtype=dtype, device=CUDA)
    res = pl.kv_attention(qd.to(CUDA), kd.to(CUDA), vd.to(CUDA), positions.to(CUDA), tables.to(CUDA), kc_gpu,
                          vc_gpu, h, kv, d, out=out, **kw)
    torch.cuda.synchronize()
    assert res is out and kc_gpu.data_ptr() == ptr

    kc_ref, vc_ref = kc.float(), vc.float()
    ref = reference.kv_attention(qd.float(), kd.float(), vd.float(), positions, tables, kc_ref, vc_ref,
                                 h, kv, d)
    got = out.float().cpu()
    msg = (f"seed={gen.initial_seed()} dtype={dtype} h={h} kv={kv} d={d} bs={kc.shape[1]} "
           f"positions={positions.tolist()}")
    assert torch.isfinite(got).all(), msg
    live = positions >= 0
    torch.testing.assert_close(got[live], ref[live], **TOL[dtype], msg=lambda m: f"{m}\n{msg}")
    # the trash block (last) takes the padding rows' writes in an unspecified order
    assert torch.equal(kc_gpu.float().cpu()[:-1], kc_ref[:-1]), "k cache " + msg
    assert torch.equal(vc_gpu.float().cpu()[:-1], vc_ref[:-1]), "v cache " + msg


HEADS = [(32, 8, 128), (16, 2, 64), (4, 4, 32), (8, 1, 16)]  # (H, KV, d): GQA groups 4, 8, 1, 8


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("h,kv,d", HEADS)
@pytest.mark.parametrize("k_spec", [1, 3, 7, 11, 15])
def test_kv_attention_verify_rows_ragged(pl, gen, dtype, h, kv, d, k_spec):
    s = k_spec + 1  # K drafts + the last accepted token
    contexts = [CONTEXTS[rand_int(gen, 0, len(CONTEXTS) - 1)] for _ in range(3)]
    batch = make_batch(gen, 3, s, h, kv, d, contexts)
    check_attention(pl, gen, dtype, *batch, h, kv, d)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k_spec", [3, 7, 15])
def test_kv_attention_drafter_rows(pl, gen, dtype, k_spec):
    """P + K - 1 rows per request (pending rows then mask rows), the drafter's single pass."""
    h, kv, d = 32, 8, 128
    p = rand_int(gen, 1, 8)
    contexts = [rand_int(gen, 0, 3000) for _ in range(4)]
    batch = make_batch(gen, 4, p + k_spec - 1, h, kv, d, contexts, shuffle=False)
    check_attention(pl, gen, dtype, *batch, h, kv, d)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, None, 7])
def test_kv_attention_long_contexts(pl, gen, dtype, num_splits):
    """8k contexts: one program walks 8k keys through the table (num_splits=1), or the context is split
    in segments, as many as the shape asks for (None: 3 x 8 x 2 programs, so several) or 7."""
    h, kv, d = 32, 8, 128
    contexts = [8000, rand_int(gen, 4000, 8100), rand_int(gen, 0, 300)]
    batch = make_batch(gen, 3, 8, h, kv, d, contexts, max_len=8200, block_size=32)  # M * bs = 8224 keys
    check_attention(pl, gen, dtype, *batch, h, kv, d, num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [24, 1, 64])
def test_kv_attention_other_block_sizes(pl, gen, dtype, block_size):
    """Blocks that do not divide the 16-key step (24), one position per block, several steps per block."""
    h, kv, d = 16, 4, 64
    contexts = [rand_int(gen, 0, 700), rand_int(gen, 0, 50), 300]
    batch = make_batch(gen, 3, 8, h, kv, d, contexts, block_size=block_size)
    check_attention(pl, gen, dtype, *batch, h, kv, d)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kv_attention_rows_past_the_table(pl, gen, dtype):
    """The drafter's lookahead rows at the end of the context sit past the table (M * bs and beyond):
    they write the trash block and see every key the table addresses, as in the reference."""
    h, kv, d, bs, s = 8, 2, 64, 16, 12
    contexts = [40, 60]
    q, k, v, positions, tables, kc, vc = make_batch(gen, 2, s, h, kv, d, contexts, max_len=64, block_size=bs,
                                                    shuffle=False, full=True)
    assert tables.shape[1] * bs == 64 and int(positions.max()) >= 64  # rows 64 .. 71 of request 1
    check_attention(pl, gen, dtype, q, k, v, positions, tables, kc, vc, h, kv, d)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("s,h,kv,d", [(256, 32, 8, 128), (300, 16, 2, 64), (97, 8, 8, 32)])
def test_kv_attention_prefill_chunks(pl, gen, dtype, s, h, kv, d):
    """Larger S (chunked prefill): many row tiles, causal within the chunk."""
    contexts = [0, rand_int(gen, 1, 2000)]
    batch = make_batch(gen, 2, s, h, kv, d, contexts, shuffle=False, full=True)
    check_attention(pl, gen, dtype, *batch, h, kv, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("h,kv,d", [(8, 2, 128), (4, 1, 64), (6, 3, 96), (2, 2, 8)])
def test_kv_attention_head_sizes_and_fp32(pl, gen, dtype, h, kv, d):
    """fp32 activations (IEEE products, no TF32) and head sizes that are no power of two."""
    contexts = [rand_int(gen, 0, 600), 300, 0]
    batch = make_batch(gen, 3, 8, h, kv, d, contexts)
    check_attention(pl, gen, dtype, *batch, h, kv, d)


def test_kv_attention_explicit_scale(pl, gen):
    h, kv, d, dtype = 8, 2, 64, torch.float16
    q, k, v, positions, tables, kc, vc = make_batch(gen, 2, 4, h, kv, d, [10, 100])
    out = pl.kv_attention(q.to(dtype).cuda(), k.to(dtype).cuda(), v.to(dtype).cuda(), positions.cuda(),
                          tables.cuda(), kc.to(dtype).cuda(), vc.to(dtype).cuda(), h, kv, d, 0.05)
    ref = reference.kv_attention(q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), positions,
                                 tables, kc.to(dtype).float(), vc.to(dtype).float(), h, kv, d, 0.05)
    live = positions >= 0
    torch.testing.assert_close(out.float().cpu()[live], ref[live], **TOL[dtype])


@pytest.mark.skipif(FP8 is None, reason="torch without float8_e4m3fn")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("h,kv,d", [(32, 8, 128), (16, 2, 64), (8, 1, 16)])
@pytest.mark.parametrize("s", [4, 16, 8])
def test_kv_attention_fp8_cache(pl, gen, dtype, h, kv, d, s):
    """FP8 cache, per-tensor scales: the kernel stores fp8(value / scale) and attends over
    stored * scale; compared with the reference run on the dequantized cache."""
    contexts = [rand_int(gen, 0, 5000), rand_int(gen, 0, 300), 0]
    q, k, v, positions, tables, kc, vc = make_batch(gen, 3, s, h, kv, d, contexts)
    qd, kd, vd = (x.to(dtype) for x in (q, k, v))
    k_scale, v_scale = 0.02 + 0.05 * float(torch.rand(1, generator=gen)), 0.03
    kc8 = (kc * 2).to(FP8)  # stale contents, any fp8 codes
    vc8 = (vc * 2).to(FP8)
    kc_gpu, vc_gpu = kc8.to(CUDA), vc8.to(CUDA)
    out = torch.full(qd.shape, float("nan"), dtype=dtype, device=CUDA)
    pl.kv_attention(qd.cuda(), kd.cuda(), vd.cuda(), positions.cuda(), tables.cuda(), kc_gpu, vc_gpu, h, kv, d,
                    k_scale=k_scale, v_scale=v_scale, out=out)
    torch.cuda.synchronize()

    # expected stored codes: the reference write, in the fp8 domain (same indexing as the reference)
    kq, vq = (kd.float() / k_scale).to(FP8), (vd.float() / v_scale).to(FP8)
    block, offset = reference.block_rows(tables, positions, kc.shape[0] - 1, kc.shape[1])  # [B, S] each
    exp_k, exp_v = kc8.clone(), vc8.clone()
    exp_k[block, offset] = kq.view(*positions.shape, kv, d)
    exp_v[block, offset] = vq.view(*positions.shape, kv, d)
    msg = f"seed={gen.initial_seed()} dtype={dtype} h={h} kv={kv} d={d} s={s}"
    got_k, got_v = kc_gpu.cpu(), vc_gpu.cpu()
    assert torch.equal(got_k[:-1].float(), exp_k[:-1].float()), "k cache codes " + msg  # trash block aside
    assert torch.equal(got_v[:-1].float(), exp_v[:-1].float()), "v cache codes " + msg

    # attention: the reference over the dequantized cache, writing the dequantized new rows
    ref = reference.kv_attention(qd.float(), kq.float() * k_scale, vq.float() * v_scale, positions, tables,
                                 kc8.float() * k_scale, vc8.float() * v_scale, h, kv, d)
    got = out.float().cpu()
    assert torch.isfinite(got).all(), msg
    live = positions >= 0
    torch.testing.assert_close(got[live], ref[live], **TOL[dtype], msg=lambda m: f"{m}\n{msg}")


def test_kv_attention_leaves_other_blocks_alone(pl, gen):
    h, kv, d, dtype, bs = 8, 2, 64, torch.bfloat16, 16
    q, k, v, positions, tables, kc, vc = make_batch(gen, 2, 4, h, kv, d, [50, 7], block_size=bs, spare=4)
    kc_gpu, vc_gpu = kc.to(dtype).cuda(), vc.to(dtype).cuda()
    before = kc_gpu.clone(), vc_gpu.clone()
    pl.kv_attention(q.to(dtype).cuda(), k.to(dtype).cuda(), v.to(dtype).cuda(), positions.cuda(),
                    tables.cuda(), kc_gpu, vc_gpu, h, kv, d)
    torch.cuda.synchronize()
    trash = kc.shape[0] - 1
    used = set(tables[tables >= 0].tolist())
    others = [i for i in range(trash) if i not in used]
    assert len(others) == 4
    assert torch.equal(kc_gpu[others], before[0][others]) and torch.equal(vc_gpu[others], before[1][others])
    # written positions hold exactly the new k/v; positions past each request's rows are untouched
    for i in range(2):
        for j, p in enumerate(positions[i].tolist()):
            if p >= 0:
                block = int(tables[i, p // bs])
                assert torch.equal(kc_gpu[block, p % bs].cpu(), k[i, j].to(dtype).view(kv, d))
                assert torch.equal(vc_gpu[block, p % bs].cpu(), v[i, j].to(dtype).view(kv, d))
        top = int(positions[i].max()) + 1
        for p in range(top, int((tables[i] >= 0).sum()) * bs):
            block = int(tables[i, p // bs])
            assert torch.equal(kc_gpu[block, p % bs], before[0][block, p % bs]), (i, p)


# ---- PEagleDraftInputs ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k_spec", [1, 3, 7, 11, 15])
@pytest.mark.parametrize("hidden", [256, 100, 33])
def test_draft_inputs_layout(pl, gen, dtype, k_spec, hidden):
    b, p, vocab = 4, 6, 1000
    tokens = torch.randint(0, vocab, (b, p), generator=gen)
    pending_hidden = torch.randn(b, p, hidden, generator=gen).to(dtype)
    n = torch.randint(1, p + 1, (b,), generator=gen)
    n[0] = p  # one request with every pending row real
    cur = n + torch.randint(0, 500, (b,), generator=gen)
    embed = torch.randn(vocab, hidden, generator=gen).to(dtype)
    h_mask = torch.randn(hidden, generator=gen).to(dtype)
    mask_id = rand_int(gen, 0, vocab - 1)
    r = p + k_spec - 1
    out = (torch.full((b, r, hidden), float("nan"), dtype=dtype, device=CUDA),
           torch.full((b, r, hidden), float("nan"), dtype=dtype, device=CUDA),
           torch.full((b, r), -12345, dtype=torch.int64, device=CUDA),
           torch.full((b, k_spec), -12345, dtype=torch.int64, device=CUDA))
    got = pl.draft_inputs(tokens.cuda(), pending_hidden.cuda(), n.cuda(), cur.cuda(), embed.cuda(),
                          h_mask.cuda(), k_spec, mask_id, out=out)
    ref = reference.draft_inputs(tokens, pending_hidden, n, cur, embed, h_mask, k_spec, mask_id)
    for name, g_, r_ in zip(("embeds", "hidden", "positions", "sample_rows"), got, ref):
        assert torch.equal(g_.cpu(), r_), \
            f"{name} seed={gen.initial_seed()} n={n.tolist()} cur={cur.tolist()}"


def test_draft_inputs_worked_example(pl):
    """The example of the reference docstring: K=3, n=2, cur=12."""
    embed = torch.arange(100 * 4, dtype=torch.float32).view(100, 4).cuda()
    tokens = torch.tensor([[5, 6, 0], [7, 8, 9]]).cuda()
    hidden = torch.randn(2, 3, 4).cuda()
    n, cur = torch.tensor([2, 3]).cuda(), torch.tensor([12, 40]).cuda()
    e, g, pos, rows = pl.draft_inputs(tokens, hidden, n, cur, embed, torch.ones(4).cuda(), 3, 99)
    assert pos.tolist() == [[10, 11, 12, 13, -1], [37, 38, 39, 40, 41]]
    assert rows.tolist() == [[1, 2, 3], [2, 3, 4]]
    assert torch.equal(e[0, :4], embed[[5, 6, 99, 99]])
    assert torch.all(e[0, 4] == 0) and torch.all(g[0, 4] == 0)


# ---- PEagleDraftSample ---------------------------------------------------------------------------

@pytest.mark.parametrize("vocab", [7, 1000, 4099, 32000, 151936, 201088])
def test_draft_sample_argmax_ties_and_d2t(pl, gen, vocab):
    b, k = 3, 7
    logits = torch.randn(b, k, vocab, generator=gen)
    top = float(logits.max()) + 1.0
    # ties: several copies of the maximum, spread over the vocabulary (and over the split chunks)
    for row in range(b * k):
        copies = torch.randint(0, vocab, (rand_int(gen, 1, 4),), generator=gen)
        logits.view(-1, vocab)[row, copies] = top
    logits[0, 1] = float("-inf")           # all -inf: index 0
    if vocab > 3:
        logits[1, 2, [vocab - 1, 3]] = float("nan")  # NaN is the maximum: first NaN wins
    d2t = torch.randint(0, 50, (vocab,), generator=gen)
    out = torch.full((b, k), -12345, dtype=torch.int64, device=CUDA)
    got = pl.draft_sample(logits.cuda(), d2t.cuda(), out=out)
    assert got is out
    ref = reference.draft_sample(logits, d2t)
    assert torch.equal(got.cpu(), ref), f"seed={gen.initial_seed()} got={got.tolist()} ref={ref.tolist()}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_draft_sample_half_logits(pl, gen, dtype):
    logits = torch.randn(5, 3, 32000, generator=gen).to(dtype)
    d2t = torch.randint(0, 9, (32000,), generator=gen)
    assert torch.equal(pl.draft_sample(logits.cuda(), d2t.cuda()).cpu(), reference.draft_sample(logits, d2t))


# ---- the torch executor on the kernels ----------------------------------------------------------

def test_enable_routes_the_torch_executor(pl, tiny, monkeypatch):
    """Greedy P-EAGLE generation on CUDA (fp32) gives the same tokens with the kernels as with the
    reference ops, and the kernels are really called."""
    from peagle_trt.checkpoint import load_pair
    from peagle_trt.config import SpecConfig
    from peagle_trt.executors.torch import TorchExecutor
    from peagle_trt.runtime.scheduler import generate
    from peagle_trt.speculative.decoder import SpecDecoder
    from tests.helpers import greedy

    spec = SpecConfig("peagle", 3)
    pair = load_pair(tiny["llama"], tiny["aws"], spec)
    prompt = list(range(3, 40))

    def run() -> list[int]:
        target, drafter = pair.build("cuda", torch.float32)
        decoder = SpecDecoder(TorchExecutor(target, drafter, 1, max_len=256), spec)
        return generate(decoder, prompt, greedy(40)).output

    expected = run()
    calls = {"kv_attention": 0, "draft_inputs": 0, "draft_sample": 0}
    for name in calls:
        fn = getattr(pl, name)

        def counted(*a, _fn=fn, _name=name, **kw):
            calls[_name] += 1
            return _fn(*a, **kw)

        monkeypatch.setattr(pl, name, counted)
    pl.enable()
    try:
        got = run()
    finally:
        pl.disable()
    assert not pl.enabled()
    assert all(n > 0 for n in calls.values()), calls
    assert got == expected


def test_unsupported_inputs_raise(pl):
    q = torch.zeros(1, 1, 8, dtype=torch.float16, device=CUDA)
    positions = torch.zeros(1, 1, dtype=torch.int64, device=CUDA)
    tables = torch.zeros(1, 1, dtype=torch.int64, device=CUDA)  # [B, M]
    cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16, device=CUDA)  # cache dtype != q dtype
    with pytest.raises(TypeError):
        pl.kv_attention(q, q, q, positions, tables, cache, cache.clone(), 1, 1, 8)
    strided = torch.zeros(2, 8, 1, 4, dtype=torch.float16, device=CUDA).transpose(1, 3)  # [2, 4, 1, 8]
    with pytest.raises(ValueError, match="contiguous"):
        pl.kv_attention(q, q, q, positions, tables, strided, cache.half(), 1, 1, 8)
    with pytest.raises(ValueError, match="block_tables"):  # the slots [B] of the contiguous cache
        pl.kv_attention(q, q, q, positions, tables[:, 0], cache.half(), cache.half(), 1, 1, 8)
    old = torch.zeros(2, 1, 4, 8, dtype=torch.float16, device=CUDA)  # [N, KV, T+1, d]: KV heads at axis 1
    with pytest.raises(ValueError, match="do not match"):
        pl.kv_attention(q, q, q, positions, tables, old, old.clone(), 1, 1, 8)
