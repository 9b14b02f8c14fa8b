"""The seeds' targets (peagle_trt/bench/seed_models.py) and `peagle-trt bench seeds` (peagle_trt/bench/seeds.py).

The published configs resolve, through the family adapters, to the published architectures (moe.md's
table) and, built on the meta device, to the published parameter counts; GPT-OSS-120B fits one
H200 only with FP8 experts. The SMALL shapes keep every rule of the real ones (only sizes differ),
and build and run on the CPU with their FP8 parts and heads. The synthetic acceptance reproduces
the published acceptance lengths. The suite's --smoke runs every section end to end (a few seconds
on one thread), --budget-s skips what would start late, and without CUDA the real run refuses.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from peagle_trt.bench import seed_models as sm
from peagle_trt.bench.cli import run_suite
from peagle_trt.bench.seeds import ACCEPTANCE, MODES, fit_rates, synthetic_rates
from peagle_trt.cli import main
from peagle_trt.errors import ConfigError
from peagle_trt.models.layers import Attention
from peagle_trt.models.moe import SparseMoE
from peagle_trt.models.target import TargetModel

H200_BYTES = 143771 * 2 ** 20  # torch.cuda.get_device_properties(...).total_memory of an H200


def test_the_published_configs_resolve_to_the_published_architectures():
    q, g20, g120 = (sm.target_config(n) for n in ("qwen3-coder-30b-a3b", "gpt-oss-20b", "gpt-oss-120b"))
    assert (q.num_layers, q.hidden_size, q.num_heads, q.num_kv_heads, q.head_dim, q.vocab_size) == (
        48, 2048, 32, 4, 128, 151936)
    assert (q.moe.num_experts, q.moe.top_k, q.moe.intermediate_size, q.moe.routing, q.moe.norm_topk_prob) == (
        128, 8, 768, "softmax_topk", True)
    assert q.qk_norm and all(q.moe_layers) and not q.layer_windows and not q.attention_sinks
    for c, layers, experts in ((g20, 24, 32), (g120, 36, 128)):
        assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (
            layers, 2880, 64, 8, 64, 201088)
        assert (c.moe.num_experts, c.moe.top_k, c.moe.intermediate_size, c.moe.routing) == (
            experts, 4, 2880, "topk_softmax")
        assert c.moe.router_bias and c.moe.expert_bias and c.moe.activation == "clamped_swiglu"
        assert c.attention_sinks and c.attention_bias and c.rope.rope_type == "yarn"
        assert c.layer_windows == (128, 0) * (layers // 2)  # sliding / full, alternating


@pytest.mark.parametrize("name, billions", [("gpt-oss-20b", 20.9), ("gpt-oss-120b", 116.8), pytest.param(
    "qwen3-coder-30b-a3b", 30.5, marks=pytest.mark.slow)])  # slow: 6,144 per-expert modules, ~3 s on meta
def test_the_full_models_on_meta_have_the_published_sizes(name, billions):
    c = sm.target_config(name)
    with torch.device("meta"):
        model = TargetModel(c, c.default_taps)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.05)
    s = sm.SEEDS[name]
    as_built = sm.weight_bytes(model, s.experts, s.attention_fp8, torch.bfloat16)
    assert as_built < 0.9 * H200_BYTES  # the build's own check passes on an H200
    if name == "gpt-oss-120b":  # only because its experts go FP8 as built
        assert sm.weight_bytes(model, "bf16", False, torch.bfloat16) > H200_BYTES


@pytest.mark.parametrize("name", sorted(sm.SEEDS))
def test_small_shapes_keep_every_rule_of_the_real_ones(name):
    small, real = sm.target_config(name, 4, small=True), sm.target_config(name, 4)
    sizes = {f: getattr(real, f) for f in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                                            "intermediate_size", "layer_windows")}
    moe = dataclasses.replace(small.moe, num_experts=real.moe.num_experts, top_k=real.moe.top_k,
                              intermediate_size=real.moe.intermediate_size)
    assert dataclasses.replace(small, moe=moe, **sizes) == real
    assert [w > 0 for w in small.layer_windows] == [w > 0 for w in real.layer_windows]


@pytest.mark.parametrize("name", sorted(sm.SEEDS))
def test_small_targets_and_heads_build_and_run_on_cpu(name):
    built = sm.build_target(name, "cpu", torch.float32, layers=4, small=True)
    model = built.model
    fp8 = {kind: any(p.dtype == torch.float8_e4m3fn for m in model.modules() if isinstance(m, cls)
                     for p in m.parameters())
           for kind, cls in (("experts", SparseMoE), ("attention", Attention))}
    assert fp8 == {"experts": built.experts != "bf16", "attention": built.attention_fp8}
    assert built.experts == sm.SEEDS[name].experts  # as the seed asks: no format falls back
    peagle, eagle3 = (sm.build_head(name, kind, model, torch.float32) for kind in ("peagle", "eagle3"))
    assert (peagle.config.num_layers, eagle3.config.num_layers) == (4, 1)
    assert peagle.config.supports_parallel and not eagle3.config.supports_parallel
    assert eagle3.embed_tokens is model.embed_tokens and peagle.embed_tokens is not model.embed_tokens
    tokens, positions = torch.randint(0, 512, (1, 3)), torch.arange(3)[None]
    logits, aux = model(tokens, positions, torch.arange(1), model.new_cache(1, 32))
    assert logits.shape == (1, 3, 512) and aux.shape == (1, 3, 3 * 64) and torch.isfinite(logits).all()


def test_heads_at_the_published_sizes_are_the_published_heads():
    h = sm.head_config("gpt-oss-20b", "peagle", sm.target_config("gpt-oss-20b"))
    assert (h.hidden_size, h.num_layers, h.intermediate_size, h.draft_vocab_size, h.mask_token_id) == (
        2880, 4, 17280, 201088, 201020)
    e = sm.head_config("gpt-oss-120b", "eagle3", sm.target_config("gpt-oss-120b"))
    assert (e.num_layers, e.draft_vocab_size, e.has_mask_hidden, e.has_embed) == (1, 32000, False, False)


def test_synthetic_acceptance_reproduces_the_published_lengths():
    for (name, mode), a in ACCEPTANCE.items():
        for k, al in a.points:
            assert 1 + sum(fit_rates(a.points, k)) == pytest.approx(al, abs=1e-4), (name, mode, k)
        for m, k in MODES[name]:
            if m == mode:
                rates = synthetic_rates(name, mode, k)
                assert len(rates) == k and all(1 >= x >= y > 0 for x, y in zip(rates, rates[1:]))
    assert synthetic_rates("gpt-oss-120b", "eagle3", 3) == (0.72, 0.50, 0.33)  # published per position
    with pytest.raises(ConfigError, match="does not follow"):
        fit_rates(((2, 3.5),), 2)  # 2.5 accepted drafts out of 2


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: more threads only wait on busy cores
    yield
    torch.set_num_threads(threads)


def test_seeds_smoke_runs_every_section(tmp_path, one_thread):
    result = run_suite("seeds", ["--smoke", "--output-dir", str(tmp_path)])
    assert result == json.loads((tmp_path / "bench_seeds.json").read_text())
    assert result["errors"] == {} and result["skipped"] == [] and result["smoke"] is True
    assert {(r["target"], r["mode"], r["k"]) for r in result["table"]} == {
        (n, m, k) for n, modes in MODES.items() for m, k in modes}
    assert all(r["tok_s"] > 0 and r["tok_s_per_user"] == r["tok_s"] / r["concurrency"] for r in result["table"])
    assert all(r["acceptance_length"] == 1 for r in result["table"] if r["mode"] == "none")
    for name in sm.SEEDS:
        top_k = sm.SMALL[sm.SEEDS[name].config["model_type"]]["num_experts_per_tok"]
        curve = [r for r in result["curve"] if r["target"] == name]
        assert [r["rows"] for r in curve] == [1, 2, 3, 4]
        assert curve[0]["experts_mean"] == curve[0]["experts_max"] == top_k  # one row: exactly its top-k
        assert all(top_k <= r["experts_mean"] <= r["experts_max"] <= min(r["experts"], top_k * r["rows"])
                   for r in curve)
        k_max = max(k for m, k in MODES[name] if m == "peagle")
        configs = [r["config"] for r in result["adaptive"] if r["target"] == name]
        assert configs == ["none", f"adaptive K<={k_max}"] + [f"K={k}" for k in range(1, k_max + 1)]
    assert {t["target"].split(" ")[0] for t in result["targets"]} == set(sm.SEEDS)
    assert all(t["met"] is None for t in result["targets"])  # layer slices: no target is judged
    report = (tmp_path / "bench_seeds.md").read_text()
    assert "SMOKE run" in report and "published B200" in report and "Verify cost curve" in report


def test_the_budget_skips_what_would_start_late(one_thread):
    result = run_suite("seeds", ["--smoke", "--budget-s", "0", "--targets", "gpt-oss-20b"])
    assert result["skipped"] == ["gpt-oss-20b: build"] and not result["table"] and not result["built"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_without_cuda_the_real_run_stops_with_a_clear_error(capsys):
    assert main(["bench", "seeds"]) == 2
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["error_type"] == "ConfigError" and "--smoke" in last["error"]
