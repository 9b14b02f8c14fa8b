"""Split-KV (flash-decoding) form of the Triton KV attention (peagle_trt/ops/triton_kernels/kv_attention.py:
kv_attention_split_kernel + kv_reduce_kernel) against the torch reference, under the Triton interpreter.

What it checks: forced segment counts (2, 3, 7, more segments than keys) over ragged batches with
padding rows, GQA groups sharing one tile, windows, sinks (merged in the reduce), bf16 / fp32, block
sizes that do not divide the segment length (12, 24: segment boundaries fall inside blocks), draft
trees (steps aligned on the tree's first row, so boundaries fall between steps), the FP8 cache; the
split result against the unsplit kernel; the shape-only plan (`split_plan`), and deterministic mode
keeping the unsplit kernel (a row's bits independent of the batch). Outputs are poisoned with NaN
and unused cache blocks hold NaN (tests/ops/test_triton_kernels.py's helpers).
On a GPU: PEAGLE_TRITON_DEVICE=cuda pytest -m kernels tests/ops/test_kv_attention_split.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.conftest import DEVICE, other_triton  # noqa: F401  (sets TRITON_INTERPRET=1 on CPU first)

pytest.importorskip("triton", reason="pip install -c constraints.txt 'peagle-trt[dev]' (triton==3.9.0)")

from peagle_trt.ops import deterministic, reference  # noqa: E402
from peagle_trt.ops.reference import pack_tree_mask  # noqa: E402
from peagle_trt.ops.triton_kernels import kv_attention, variants  # noqa: E402
from peagle_trt.ops.triton_kernels.common import FP8  # noqa: E402
from tests.ops.test_triton_kernels import _check_attention, _paged_case, _run, _same_writes  # noqa: E402

pytestmark = pytest.mark.kernels

CASES = {  # rows per request (-1 = padding), heads, kv heads, head size, block size
    "decode-ragged-gqa": ([[70], [9], [-1]], 8, 2, 16, 12),
    "verify-k3-gqa": ([[90, 91, 92, 93], [40, 41, -1, -1]], 8, 2, 16, 24),
    "verify-k7-two-tiles": ([list(range(60, 68))], 4, 1, 24, 8),  # 8 rows x 4 heads: two 16-row tiles
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("window,with_sinks", [(0, False), (20, True)])
def test_split_matches_the_reference(dtype, case, splits, window, with_sinks):
    rows, h, kv, d, bs = CASES[case]
    gen = torch.Generator().manual_seed(splits * 100 + window)
    q, k, v, positions, tables, kc, vc = _paged_case(gen, rows, h, kv, d, bs, dtype, window)
    sinks = torch.randn(h, generator=gen) if with_sinks else None
    got, kc_got, vc_got = _run(q, k, v, positions, tables, kc.clone(), vc.clone(), h, kv, d,
                               sliding_window=window, sinks=sinks, num_splits=splits)
    want = reference.kv_attention(q, k, v, positions, tables, kc, vc, h, kv, d, None, window, sinks)
    _same_writes(kc_got, kc)
    _same_writes(vc_got, vc)
    _check_attention(got, want, positions, dtype)


def test_split_equals_unsplit_and_tolerates_empty_segments():
    """fp32: the merged segments equal the one-pass softmax to rounding; 64 segments of 16 keys over
    a context of ~90 leave most segments empty (m = -inf, l = 0), which must weigh nothing."""
    rows, h, kv, d, bs = CASES["verify-k3-gqa"]
    gen = torch.Generator().manual_seed(5)
    q, _, _, positions, tables, kc, vc = _paged_case(gen, rows, h, kv, d, bs, torch.float32)
    tables = torch.cat([tables, torch.full((2, 40), -1)], 1)  # a table sized for a longer context
    one, _, _ = _run(q, None, None, positions, tables, kc, vc, h, kv, d, num_splits=1)
    for splits in (2, 64):
        got, _, _ = _run(q, None, None, positions, tables, kc, vc, h, kv, d, num_splits=splits)
        live = positions >= 0
        torch.testing.assert_close(got[live], one[live], atol=1e-5, rtol=1e-5)
        assert torch.equal(got[~live], torch.zeros_like(got[~live]))  # padding rows: zeros, as unsplit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [2, 5])
def test_split_tree_mask(dtype, splits):
    """Draft-tree rows: the step grid starts at the tree's first slot (not a multiple of 16), so
    segment boundaries are moved onto it; the tree's own rows may straddle a boundary."""
    from peagle_trt.speculative.tree import depths

    trees, cur, h, kv, d, bs = [(-1, -1, 0, 0, 2, 1), (-1, 0, 1)], [53, 29], 4, 2, 16, 12
    n = max(len(t) for t in trees) + 1
    positions = [[c] + [c + x for x in depths(t)] + [-1] * (n - 1 - len(t)) for t, c in zip(trees, cur)]
    slots = [[c + s for s in range(n)] for c in cur]
    gen = torch.Generator().manual_seed(splits)
    q, k, v, _, tables, kc, vc = _paged_case(gen, slots, h, kv, d, bs, dtype)
    positions = torch.tensor(positions)
    mask = torch.from_numpy(pack_tree_mask(trees, n))
    for window in (0, 40):
        got, _, _ = _run(q, k, v, positions, tables, kc.clone(), vc.clone(), h, kv, d, sliding_window=window,
                         tree_mask=mask, num_splits=splits)
        want = reference.kv_attention(q, k, v, positions, tables, kc.clone(), vc.clone(), h, kv, d, None, window,
                                      None, mask)
        _check_attention(got, want, positions, dtype)


@pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_fp8_cache(dtype):
    rows, h, kv, d, bs = CASES["decode-ragged-gqa"]
    gen = torch.Generator().manual_seed(9)
    q, _, _, positions, tables, kc, vc = _paged_case(gen, rows, h, kv, d, bs, dtype)
    k_scale, v_scale = 0.05, 0.03
    kc8, vc8 = (kc.float() / k_scale).to(FP8), (vc.float() / v_scale).to(FP8)
    sinks = torch.randn(h, generator=gen)
    got, _, _ = _run(q, None, None, positions, tables, kc8, vc8, h, kv, d, sinks=sinks, k_scale=k_scale,
                     v_scale=v_scale, num_splits=3)
    want = reference.kv_attention(q.float(), None, None, positions, tables, kc8.float() * k_scale,
                                  vc8.float() * v_scale, h, kv, d, None, 0, sinks)
    _check_attention(got, want.to(dtype), positions, dtype)


def test_split_plan_is_by_shape():
    plan = kv_attention.split_plan
    assert plan(1, 8, 1, 8192, 132) == 32  # 8 programs on 132 SMs: 32 segments (of 256 keys at this span)
    assert plan(1, 8, 2, 8192, 132) == 17  # 16 programs: 17 segments fill 2 waves
    assert plan(32, 8, 2, 8192, 132) == 1  # 512 programs fill the GPU
    assert plan(1, 8, 2, 300, 132) == 1  # too short to split
    assert plan(1, 1, 1, 32768, 132) == kv_attention.MAX_SPLITS


def test_tiles_hold_a_verify_per_kv_head():
    """All S x G rows of one KV head in one tile (up to 64), so each KV block is read once per KV head;
    16-row tiles in deterministic mode and for fp32; fewer keys per step for trees (one mask word)."""
    tiles = kv_attention.tiles_for
    assert tiles(1 * 4, 128, torch.bfloat16, False).block_m == 16  # decode, GQA 4
    assert tiles(8 * 4, 128, torch.bfloat16, False).block_m == 32  # verify K = 7
    assert tiles(14 * 4, 128, torch.bfloat16, False).block_m == 64  # drafter pass P + K - 1 = 14
    assert tiles(14 * 4, 128, torch.bfloat16, False, fixed_rows=True).block_m == 16
    assert tiles(8 * 4, 128, torch.float32, False).block_m == 16
    assert tiles(8, 128, torch.bfloat16, True).block_n == 32 and 32 % tiles(8, 128, torch.bfloat16, True).block_n == 0


def test_tall_tiles_and_config_override_match_the_reference():
    """A 56-row tile (S = 14 rows x G = 4) in one program, and a forced tiling (`config=`: what
    bench kernels sweeps), split and unsplit, against the reference."""
    h, kv, d, bs = 8, 2, 16, 8
    gen = torch.Generator().manual_seed(5)
    rows = [list(range(80, 94)), list(range(30, 44))]
    q, k, v, positions, tables, kc, vc = _paged_case(gen, rows, h, kv, d, bs, torch.bfloat16, 0)
    want = reference.kv_attention(q, k, v, positions, tables, kc.clone(), vc.clone(), h, kv, d)
    for config, splits in ((None, 3), (kv_attention.Tiles(32, 16, 4, 2), 1), (kv_attention.Tiles(64, 32, 4, 3), 2)):
        got, _, _ = _run(q, k, v, positions, tables, kc.clone(), vc.clone(), h, kv, d, num_splits=splits,
                         config=config)
        _check_attention(got, want, positions, torch.bfloat16)


def test_deterministic_mode_keeps_the_unsplit_kernel():
    """The plan depends on the batch (a lone request splits, a full batch does not), so a row's bits
    would depend on its batch: inside deterministic.rows() an unforced launch stays unsplit. The
    table addresses 512 keys, which a lone request would otherwise split in two."""
    h, kv, d, bs = 4, 2, 16, 8
    gen = torch.Generator().manual_seed(2)
    q, _, _, positions, tables, kc, vc = _paged_case(gen, [[70], [44]], h, kv, d, bs, torch.float32)
    tables = torch.cat([tables, torch.full((2, 64 - tables.shape[1]), -1)], 1)  # M * bs = 512
    assert kv_attention.split_plan(1, kv, 1, 512, kv_attention.DEFAULT_SMS) == 2
    auto, _, _ = _run(q[:1], None, None, positions[:1], tables[:1], kc, vc, h, kv, d)
    split, _, _ = _run(q[:1], None, None, positions[:1], tables[:1], kc, vc, h, kv, d, num_splits=2)
    assert torch.equal(auto, split)  # outside deterministic mode the lone request is split
    unsplit, _, _ = _run(q[:1], None, None, positions[:1], tables[:1], kc, vc, h, kv, d, num_splits=1)
    with deterministic.rows():
        alone, _, _ = _run(q[:1], None, None, positions[:1], tables[:1], kc, vc, h, kv, d)
        batch, _, _ = _run(q, None, None, positions, tables, kc, vc, h, kv, d)
    assert torch.equal(alone, unsplit)
    assert torch.equal(batch[:1], alone)


def test_num_splits_must_be_positive():
    rows, h, kv, d, bs = CASES["decode-ragged-gqa"]
    q, _, _, positions, tables, kc, vc = _paged_case(torch.Generator().manual_seed(0), rows, h, kv, d, bs,
                                                     torch.float32)
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        _run(q, None, None, positions, tables, kc, vc, h, kv, d, num_splits=0)


@pytest.mark.skipif(other_triton() is not None, reason=str(other_triton()))
def test_split_kernels_compile_for_sm90a_and_sm100a_without_spills(tmp_path):
    """`aot.py --jit-only`: the split form of the plugins' widest bf16 / FP8 variants (plain and tree)
    and the reduce, as real cubins with their resources checked (the full set: aot.py --jit-only)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(repo), TRITON_DEFAULT_FP_FUSION="1")
    for only in ("kv_attention_split.bf16.fp8.d128.m64", "kv_reduce.bf16.d256"):  # the tallest tile
        out = tmp_path / only
        proc = subprocess.run([sys.executable, "-m", "peagle_trt.ops.triton_kernels.aot", str(out), "--jit-only",
                               "--only", only], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["violations"] == [] and len(manifest["cubins"]) == 4, manifest
        assert not (out / "tritonCubins.cpp").exists()  # checked, not embedded: the plugins launch the unsplit kernel


def test_jit_variants_are_not_in_the_plugins_table():
    names = [v.name for v in variants.jit_variants()]
    assert len(names) == len(set(names))
    assert not set(names) & {v.name for v in variants.all_variants()}
