"""The ahead-of-time build of the Triton kernels (peagle_trt/ops/triton_kernels/aot.py) without a GPU:
real cubins for sm_90a and sm_100a with their resources read back, the limits refused, and the
argument lists of variants.py agreeing with the hand-written launcher
(plugins/src/launcher/tritonLauncher.cpp). The full build: tests/plugins/test_kernels_build.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="pip install -c constraints.txt 'peagle-trt[dev]' (triton==3.9.0)")

from peagle_trt.errors import BuildError  # noqa: E402
from peagle_trt.ops.triton_kernels import aot, variants  # noqa: E402

pytestmark = pytest.mark.kernels
REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "plugins" / "src" / "launcher" / "tritonLauncher.cpp"


def test_draft_sample_compiles_for_sm90a_and_sm100a(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-m", "peagle_trt.ops.triton_kernels.aot", str(tmp_path),
                           "--only", "draft_sample.bf16"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.splitlines()[-1])["archs"] == [90, 100]
    entries = json.loads((tmp_path / "manifest.json").read_text())["cubins"]
    assert [(e["variant"], e["arch"]) for e in entries] == [("draft_sample.bf16", 90), ("draft_sample.bf16", 100)]
    for e in entries:
        cubin = (tmp_path / e["file"]).read_bytes()
        assert cubin[:4] == b"\x7fELF" and e["symbol"] == "draft_sample_kernel"
        assert 0 < e["registers"] <= 255 and e["local"] == 0 and e["threads"] == 128
    source = (tmp_path / "tritonCubins.cpp").read_text()
    assert source.count(".incbin") == 2 and "kNumTritonCubins = 2" in source


def test_the_moe_gemm_compiles_without_spills(tmp_path):
    """The fused MoE's heaviest kernel (gate/up with 128 x 128 block-FP8 scales, both tile regimes) for sm_90a
    and sm_100a: registers within 255, no local memory, no stack (the full set: test_kernels_build.py)."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-m", "peagle_trt.ops.triton_kernels.aot", str(tmp_path),
                           "--only", "moe_gate_up.bf16.fp8b"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    entries = json.loads((tmp_path / "manifest.json").read_text())["cubins"]
    assert sorted((e["variant"], e["arch"]) for e in entries) == [
        (f"moe_gate_up.bf16.fp8b.{r}", a) for r in ("large", "small") for a in (90, 100)]
    for e in entries:
        assert e["local"] == 0 and e["stack"] == 0 and e["registers"] <= 255 and e["symbol"] == "moe_gate_up_kernel"


def test_the_launcher_applies_the_moe_tiles_of_the_python_launcher():
    """tritonLauncher.cpp picks MoE variants and sizes their grids with constants that mirror
    peagle_trt/ops/triton_kernels/moe.py and variants.py: a drift would launch the wrong tiles."""
    import torch

    from peagle_trt.ops.triton_kernels import moe

    text = LAUNCHER.read_text()

    def const(name):
        return int(re.search(rf"constexpr int32_t {name} = (\d+);", text)[1])

    assert const("kMoeMaxExperts") == variants.MOE_EXPERTS and const("kMoeMaxTopK") == variants.MOE_TOP_K
    assert const("kMoeGroup") == moe.GROUP and const("kMoeSumBlock") == moe.SUM_BLOCK
    assert const("kMoeSmallRows") == moe.SMALL_ROWS
    tiles = [moe.regime_tiles(r, d, k) for r in ("small", "large") for d in variants.DTYPES.values()
             for k in ("none", "block")]
    assert {t.block_n for t in tiles} == {const("kMoeBlockN")}
    assert max(t.block_m for t in tiles) == const("kMoeMaxBlockM")
    assert "return small ? 16 : act == PEAGLE_F32 ? 32 : 64;" in text  # moeBlockM
    assert [moe.regime_tiles(r, torch.float32, "none").block_m for r in ("small", "large")] == [16, 32]
    assert [moe.regime_tiles(r, torch.bfloat16, "none").block_m for r in ("small", "large")] == [16, 64]
    assert "? kMoeGroup : act == PEAGLE_F32 ? 32 : 64;" in text  # moeBlockK
    assert [moe.block_k_for(d, k) for d, k in ((torch.float16, "tensor"), (torch.float32, "none"),
                                               (torch.bfloat16, "none"))] == [moe.GROUP, 32, 64]


def test_limits_are_refused():
    ok = {"variant": "v", "arch": 90, "registers": 128, "threads": 128, "stack": 0, "local": 0, "shared": 1024,
          "global_scratch": 0, "profile_scratch": 0}
    assert aot.check(ok) == []
    assert "spills" in aot.check(dict(ok, local=64))[0]
    assert aot.check(dict(ok, stack=8)) == []  # a spilled scalar (CUDA 13's ptxas, d128 tree variants)
    assert "spills" in aot.check(dict(ok, stack=aot.STACK_LIMIT + 8))[0]
    assert "registers" in aot.check(dict(ok, registers=255, threads=512))[0]
    assert "shared memory" in aot.check(dict(ok, shared=300 * 1024))[0]
    assert "scratch" in aot.check(dict(ok, global_scratch=256))[0]


def test_the_interpreter_cannot_build(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(BuildError, match="TRITON_INTERPRET=0"):
        aot.build(tmp_path, only="draft_sample")


def test_the_launcher_passes_as_many_arguments_as_each_kernel_takes():
    """The counts hard-coded in tritonLauncher.cpp (launch(..., N, stream)) equal the runtime
    arguments of every variant of that kernel; the launcher also checks them at run time."""
    text = LAUNCHER.read_text()
    counts = {}
    for kernel, n in re.findall(r'launch\((?:std::string\()?"(\w+)\.[^;]*?, (\d+), stream\)', text, re.S):
        counts[kernel] = int(n)
    counts.setdefault("kv_attention", int(re.search(r"launch\(variant, grid, attnArgs, (\d+), stream\)", text)[1]))
    assert set(counts) == {"kv_write", "kv_attention", "draft_inputs", "draft_sample", "moe_route", "moe_align",
                           "moe_quant", "moe_gate_up", "moe_down", "moe_sum"}, counts
    for v in variants.all_variants():
        assert len(v.kernel_args) == counts[v.name.split(".")[0]], v.name
    types = {v.name.split(".")[0]: [t for _, t in v.kernel_args] for v in variants.all_variants()}
    assert types["kv_attention"][15:18] == ["fp32"] * 3  # qk_scale, k_scale, v_scale: floats, not doubles
    # the head sizes the launcher and the plugin accept are the compiled ones
    accepted = " && ".join(f"head_dim != {d}" for d in variants.HEAD_DIMS)
    assert accepted in text
    plugin = (REPO / "plugins" / "src" / "plugins" / "kvAttentionPlugin.cpp").read_text()
    assert accepted.replace("head_dim", "mHeadDim") in plugin
