"""The compiled variants of the Triton kernels: what the TensorRT plugins can launch.

Each `Variant` fixes a kernel's pointer dtypes and constexprs (tile sizes, features); the runtime
arguments stay runtime (sizes, window, scales). The ahead-of-time build (`aot.py`) compiles every
variant for every architecture, and the C launcher (plugins/src/launcher/tritonLauncher.cpp)
picks one by name: `kv_attention.<act>.<cache>.d<D>.m<BLOCK_M>.<sinks|nosinks>[.tree]` and the like
below (`.tree`: the draft-tree form, with the packed ancestor mask input).
`jit_variants()`: the kernels only the torch executor launches (JIT) so far, the split-KV
(flash-decoding) attention, the FP8 GEMM, RMSNorm and RoPE, compiled and resource-checked by `aot.py --jit-only`
but not embedded: the plugins launch the unsplit attention (the launcher would need the split plan,
two more launches and a workspace for the partials; see kv_attention.py) and TensorRT runs its own
FP8 GEMMs.
`kernel_args` lists the runtime arguments in the order the compiled kernel takes them (constexprs
removed; two trailing scratch pointers follow, see aot.py).
How to test: tests/ops/test_triton_aot.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peagle_trt.ops.triton_kernels import draft_inputs, draft_sample, fp8_linear, kv_attention, moe, norm_rope

PTR = {"f32": "*fp32", "f16": "*fp16", "bf16": "*bf16", "fp8": "*fp8e4nv"}
ACTS = ("f32", "f16", "bf16")
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
HEAD_DIMS = (64, 128, 256)  # 512 (Gemma-4 global layers) spills with a 16-row tile: JIT path only
BLOCK_M = 16  # query rows (S x G) per program; more rows take more programs (grid axis 2)
NUM_WARPS = 4
MOE_EXPERTS = 256  # the MoE variants' expert bins (BLOCK_E): up to 256 experts
MOE_TOP_K = 8  # and up to 8 picks a row (BLOCK_TOPK)
MOE_WEIGHTS = ("w", "fp8t", "fp8c", "fp8b")  # act-dtype weights; FP8 per tensor, per channel, 128 x 128 blocks
MOE_KIND = {"w": "none", "fp8t": "tensor", "fp8c": "channel", "fp8b": "block"}


@dataclass(frozen=True)
class Variant:
    """One compiled form of one kernel."""
    name: str  # the launcher's key
    kernel: object  # the @triton.jit function
    signature: dict  # argument -> Triton type ("*bf16", "i32", "fp32", "constexpr")
    constexprs: dict  # constexpr argument -> value
    num_warps: int = NUM_WARPS
    num_stages: int = 3

    @property
    def kernel_args(self) -> list[tuple[str, str]]:
        """(name, type) of the runtime arguments, in order."""
        return [(a, t) for a, t in self.signature.items() if t != "constexpr"]


def _sig(fn, types: dict, constexprs: dict) -> dict:
    """Signature of `fn` in argument order: pointer / scalar types from `types`, constexprs marked."""
    out = {}
    for name in fn.arg_names:
        if name in constexprs:
            out[name] = "constexpr"
        elif name in types:
            out[name] = types[name]
        else:
            raise KeyError(f"{fn.__name__}: no type given for argument {name!r}")
    return out


def _draft_sample(act: str) -> Variant:
    fn = draft_sample.draft_sample_kernel
    consts = {"HAS_D2T": True, "BLOCK_V": draft_sample.BLOCK_V}
    types = {"logits_ptr": PTR[act], "d2t_ptr": "*i64", "ids_ptr": "*i64", "vocab": "i32"}
    return Variant(f"draft_sample.{act}", fn, _sig(fn, types, consts), consts)


def _draft_inputs(act: str) -> Variant:
    fn = draft_inputs.draft_inputs_kernel
    consts = {"BLOCK_H": 512}
    types = {n: "*i64" for n in ("tokens_ptr", "num_pending_ptr", "cur_ptr", "positions_out", "sample_rows_out")}
    types.update({n: PTR[act] for n in ("hidden_ptr", "embed_ptr", "h_mask_ptr", "embeds_out", "hidden_out")})
    types.update({"P": "i32", "R": "i32", "H": "i32", "K": "i32", "V": "i64", "mask_token_id": "i64"})
    return Variant(f"draft_inputs.{act}", fn, _sig(fn, types, consts), consts)


def _kv_write(act: str, cache: str, tree: bool = False) -> Variant:
    fn = kv_attention.kv_write_kernel
    consts = {"BLOCK": 256, "FP8_CACHE": cache == "fp8", "ROUND_FP8": False, "TREE": tree}
    types = {"k_ptr": PTR[act], "v_ptr": PTR[act], "positions_ptr": "*i64", "tables_ptr": "*i64",
             "k_cache": PTR[cache], "v_cache": PTR[cache], "S": "i32", "M": "i32", "trash": "i32", "bs": "i32",
             "k_scale": "fp32", "v_scale": "fp32", "KVD": "i32"}
    return Variant(f"kv_write.{act}.{cache}" + (".tree" if tree else ""), fn, _sig(fn, types, consts), consts)


def _tiles(act: str, d: int, tree: bool, rows: int = BLOCK_M, fixed_rows: bool = True):
    return kv_attention.tiles_for(rows, d, DTYPES[act], tree, fixed_rows=fixed_rows)


def _kv_attention(act: str, cache: str, d: int, block_m: int, sinks: bool, tree: bool = False) -> Variant:
    fn = kv_attention.kv_attention_kernel
    t = _tiles(act, d, tree, block_m)
    consts = {"D": d, "BLOCK_M": block_m, "BLOCK_D": d, "BLOCK_N": t.block_n, "HAS_SINKS": sinks,
              "FP8_CACHE": cache == "fp8", "IEEE": act == "f32", "UPCAST": False, "TREE": tree}
    types = {"q_ptr": PTR[act], "out_ptr": PTR[act], "positions_ptr": "*i64", "tables_ptr": "*i64",
             "k_cache": PTR[cache], "v_cache": PTR[cache], "sinks_ptr": "*fp32", "tree_ptr": "*i32"}
    types.update({n: "i32" for n in ("S", "M", "trash", "bs", "H", "KV", "G", "window", "W")})
    types.update({n: "fp32" for n in ("qk_scale", "k_scale", "v_scale")})
    name = f"kv_attention.{act}.{cache}.d{d}.m{block_m}.{'sinks' if sinks else 'nosinks'}" + (".tree" if tree else "")
    return Variant(name, fn, _sig(fn, types, consts), consts, num_warps=t.num_warps, num_stages=t.num_stages)


def _moe_route(logits: str) -> Variant:
    fn = moe.moe_route_kernel
    consts = {"BLOCK_E": MOE_EXPERTS, "BLOCK_TOPK": MOE_TOP_K}
    types = {"logits_ptr": PTR[logits], "scale_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32"}
    types.update({n: "i32" for n in ("E", "top_k", "routing", "renormalize", "has_scale")})
    return Variant(f"moe_route.{logits}", fn, _sig(fn, types, consts), consts)


def _moe_align(block_m: int) -> Variant:
    fn = moe.moe_align_kernel
    consts = {"BLOCK_M": block_m, "BLOCK_E": MOE_EXPERTS, "CHUNK": moe.ALIGN_TILE // MOE_EXPERTS}
    types = {n: "*i32" for n in ("ids_ptr", "sorted_ptr", "expert_ptr", "total_ptr")}
    types.update({"pairs": "i32", "num_blocks": "i32"})
    return Variant(f"moe_align.m{block_m}", fn, _sig(fn, types, consts), consts, num_warps=8)


def _moe_quant(act: str, per_row: bool) -> Variant:
    fn = moe.moe_quant_kernel
    consts = {"PER_ROW": per_row, "EMULATE": False}
    types = {"x_ptr": PTR[act], "codes_ptr": "*fp8e4nv", "scales_ptr": "*fp32", "K": "i32", "groups": "i32"}
    return Variant(f"moe_quant.{act}.{'row' if per_row else 'group'}", fn, _sig(fn, types, consts), consts)


def _moe_gemm(which: str, act: str, weights: str, regime: str) -> Variant:
    """`moe_gate_up` / `moe_down` for activations `act`, weights of kind `weights` (MOE_WEIGHTS) and
    the tiles of `regime` (moe.regime_tiles), ALIGNED (H and I multiples of BLOCK_K: the launcher checks)."""
    kind = MOE_KIND[weights]
    tiles = moe.regime_tiles(regime, DTYPES[act], kind)
    fn = moe.moe_gate_up_kernel if which == "gate_up" else moe.moe_down_kernel
    codes = kind in ("channel", "block")  # the GEMM's activations arrive as E4M3 codes (moe_quant)
    a, out = ("x_ptr", "h_ptr") if which == "gate_up" else ("h_ptr", "o_ptr")
    scales = "xs_ptr" if which == "gate_up" else "hs_ptr"
    consts = {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k,
              "NUM_STAGES": tiles.num_stages, "QUANT": moe.KINDS[kind], "ALIGNED": True, "IEEE": act == "f32",
              "UPCAST": False, "EMULATE": False}
    weight = "*fp8e4nv" if kind != "none" else PTR[act]
    types = {a: "*fp8e4nv" if codes else PTR[act], scales: "*fp32", "w_ptr": weight, "ws_ptr": "*fp32",
             "as_ptr": "*fp32", "bias_ptr": PTR[act], out: PTR[act] if which == "gate_up" else "*fp32"}
    types.update({n: "*i32" for n in ("sorted_ptr", "expert_ptr", "total_ptr")})
    types.update({n: "i32" for n in ("pairs", "top_k", "H", "inter", "k_groups", "n_groups", "activation", "has_bias")})
    types.update({"alpha": "fp32", "limit": "fp32"})
    name = f"moe_{which}.{act}.{weights}.{regime}"
    return Variant(name, fn, _sig(fn, types, consts), consts, num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _moe_sum(act: str) -> Variant:
    fn = moe.moe_sum_kernel
    consts = {"BLOCK": moe.SUM_BLOCK}
    types = {"o_ptr": "*fp32", "weights_ptr": "*fp32", "y_ptr": PTR[act], "H": "i32", "top_k": "i32"}
    return Variant(f"moe_sum.{act}", fn, _sig(fn, types, consts), consts)


def moe_variants() -> list[Variant]:
    """The fused MoE op's kernels as the plugin launches them: routing for f32 / f16 / bf16 logits (up to
    MOE_EXPERTS experts, MOE_TOP_K picks), the alignment at both regimes' BLOCK_M, the dynamic FP8
    quantization, both GEMMs for every activation dtype and weight kind (FP8 under 16-bit activations
    only, as the FP8 GEMM's variants) at both regimes, the in-order sum."""
    out = [_moe_route(a) for a in ACTS]
    out += [_moe_align(m) for m in sorted({moe.regime_tiles(r, DTYPES[a], "none").block_m
                                           for r in ("small", "large") for a in ACTS})]
    out += [_moe_quant(a, per_row) for a in ("f16", "bf16") for per_row in (True, False)]
    for act in ACTS:
        for weights in MOE_WEIGHTS if act != "f32" else ("w",):
            out += [_moe_gemm(which, act, weights, r) for which in ("gate_up", "down") for r in ("small", "large")]
    return out + [_moe_sum(a) for a in ACTS]


def all_variants() -> list[Variant]:
    """Every variant the plugins can launch: the three activation dtypes, caches of the activation
    dtype or FP8 (16-bit activations), head sizes 64, 128, 256, 16-row tiles. No sinks: the
    plugins take no sinks input yet (the JIT path of the torch executor has them). Each in a plain
    and a `.tree` form (verify over a draft tree: the packed ancestor mask)."""
    out = [_draft_sample(a) for a in ACTS] + [_draft_inputs(a) for a in ACTS]
    for act, cache in (("f32", "f32"), ("f16", "f16"), ("f16", "fp8"), ("bf16", "bf16"), ("bf16", "fp8")):
        for tree in (False, True):
            out.append(_kv_write(act, cache, tree))
            out += [_kv_attention(act, cache, d, BLOCK_M, False, tree) for d in HEAD_DIMS]
    return out + moe_variants()


def _kv_split(act: str, cache: str, d: int, tree: bool = False, rows: int = BLOCK_M) -> Variant:
    fn = kv_attention.kv_attention_split_kernel
    t = _tiles(act, d, tree, rows, fixed_rows=False)
    consts = {"D": d, "BLOCK_M": t.block_m, "BLOCK_D": d, "BLOCK_N": t.block_n,
              "FP8_CACHE": cache == "fp8", "IEEE": act == "f32", "UPCAST": False, "TREE": tree}
    types = {"q_ptr": PTR[act], "part_acc": "*fp32", "part_ml": "*fp32", "positions_ptr": "*i64",
             "tables_ptr": "*i64", "k_cache": PTR[cache], "v_cache": PTR[cache], "tree_ptr": "*i32"}
    types.update({n: "i32" for n in ("S", "M", "trash", "bs", "H", "KV", "G", "window", "W", "tiles", "splits")})
    types.update({n: "fp32" for n in ("qk_scale", "k_scale", "v_scale")})
    name = f"kv_attention_split.{act}.{cache}.d{d}.m{t.block_m}" + (".tree" if tree else "")
    return Variant(name, fn, _sig(fn, types, consts), consts, num_warps=t.num_warps, num_stages=t.num_stages)


def _kv_reduce(act: str, d: int, sinks: bool) -> Variant:
    fn = kv_attention.kv_reduce_kernel
    consts = {"D": d, "BLOCK_D": d, "BLOCK_SPLIT": kv_attention.MAX_SPLITS, "SPLIT_STEP": kv_attention.SPLIT_STEP,
              "HAS_SINKS": sinks}
    types = {"part_acc": "*fp32", "part_ml": "*fp32", "out_ptr": PTR[act], "positions_ptr": "*i64",
             "sinks_ptr": "*fp32", "B": "i32", "S": "i32", "H": "i32", "splits": "i32"}
    name = f"kv_reduce.{act}.d{d}.{'sinks' if sinks else 'nosinks'}"
    return Variant(name, fn, _sig(fn, types, consts), consts)


def _fp8_linear(act: str, cfg: fp8_linear.FP8Config, split: bool) -> Variant:
    fn = fp8_linear.fp8_linear_kernel
    consts = {"BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "ROW_GROUPS": cfg.row_groups,
              "NUM_STAGES": cfg.num_stages, "QUANT_X": not cfg.prequant, "MMA_FP8": cfg.mma == "fp8",
              "SPLIT": split, "HAS_BIAS": True, "ALIGNED": True, "EMULATE": False}
    types = {"x_ptr": "*fp8e4nv" if cfg.prequant else PTR[act], "w_ptr": "*fp8e4nv", "bias_ptr": PTR[act],
             "out_ptr": PTR[act], "part_ptr": "*fp32", "in_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "M": "i32",
             "N": "i32", "K": "i32", "seg_steps": "i32"}
    name = (f"fp8_linear.{act}.n{cfg.block_n}.k{cfg.block_k}.g{cfg.row_groups}.w{cfg.num_warps}.s{cfg.num_stages}"
            + (".pq" if cfg.prequant else "") + (".f8" if cfg.mma == "fp8" else "") + (".split" if split else ""))
    return Variant(name, fn, _sig(fn, types, consts), consts, num_warps=cfg.num_warps)


def _fp8_elementwise(act: str, kind: str, splits: int = 0) -> Variant:
    if kind == "quantize":
        fn = fp8_linear.fp8_quantize_kernel
        consts = {"BLOCK": fp8_linear.ELEMENTWISE_BLOCK, "EMULATE": False}
        types = {"x_ptr": PTR[act], "q_ptr": "*fp8e4nv", "in_scale_ptr": "*fp32", "total": "i32"}
        return Variant(f"fp8_linear_quantize.{act}", fn, _sig(fn, types, consts), consts)
    fn = fp8_linear.fp8_splitk_reduce_kernel
    consts = {"SPLIT_K": splits, "BLOCK": fp8_linear.ELEMENTWISE_BLOCK, "HAS_BIAS": True}
    types = {"part_ptr": "*fp32", "bias_ptr": PTR[act], "out_ptr": PTR[act], "in_scale_ptr": "*fp32",
             "w_scale_ptr": "*fp32", "M": "i32", "N": "i32"}
    return Variant(f"fp8_linear_reduce.{act}.s{splits}", fn, _sig(fn, types, consts), consts)


def fp8_variants(act: str) -> list[Variant]:
    """The FP8 GEMM in every config of `fp8_linear.CANDIDATES` (unsplit; each regime's default also
    split-K), ALIGNED as real layers are; the quantize kernel; the reduce at 2 and MAX_SPLIT_K segments."""
    regimes = fp8_linear.CANDIDATES.values()
    out = [_fp8_linear(act, c, False) for regime in regimes for c in regime]
    out += [_fp8_linear(act, regime[0], True) for regime in regimes]
    out = list({v.name: v for v in out}.values())  # split_k alone does not change the kernel
    out.append(_fp8_elementwise(act, "quantize"))
    return out + [_fp8_elementwise(act, "reduce", s) for s in (2, fp8_linear.MAX_SPLIT_K)]


def _norm_rope(act: str) -> list[Variant]:
    """The torch executor's RMSNorm (a 4096-wide row, weighted) and RoPE (d = 128, 16 heads a program)."""
    norm, rope = norm_rope.rms_norm_kernel, norm_rope.rope_kernel
    nc = {"BLOCK": 4096, "HAS_WEIGHT": True, "EMULATE": False}
    rc = {"HALF": 64, "BLOCK_H": 16, "BLOCK_HALF": 64, "EMULATE": False}
    nt = {"x_ptr": PTR[act], "w_ptr": PTR[act], "out_ptr": PTR[act], "N": "i32", "eps": "fp32"}
    rt = {n: PTR[act] for n in ("x_ptr", "cos_ptr", "sin_ptr", "out_ptr")}
    rt.update({"heads": "i32", "x_row": "i32", "x_head": "i32"})
    return [Variant(f"rms_norm.{act}.n4096", norm, _sig(norm, nt, nc), nc, num_warps=8),
            Variant(f"rope.{act}.d128", rope, _sig(rope, rt, rc), rc)]


def jit_variants() -> list[Variant]:
    """The split-KV kernels in the plugins' dtypes and head sizes at every tile height (the reduce at
    MAX_SPLITS segments), the FP8 GEMM's kernels (`fp8_variants`), RMSNorm and RoPE (`_norm_rope`): for
    the resource check only, not launched by the plugins. fp32 at d = 256 stays unsplit (its split
    form spills a 72 B stack on sm_90a)."""
    out = []
    for act, cache in (("f32", "f32"), ("f16", "f16"), ("f16", "fp8"), ("bf16", "bf16"), ("bf16", "fp8")):
        for tree in (False, True):
            out += [_kv_split(act, cache, d, tree, rows)  # as the JIT: every tile height, fp32 d 256 unsplit
                    for d in HEAD_DIMS if act != "f32" or d <= 128 for rows in (16, 32, 64)]
    out += [_kv_reduce(act, d, sinks) for act in ACTS for d in HEAD_DIMS for sinks in (False, True)]
    out += [v for act in ("f16", "bf16") for v in fp8_variants(act)]
    out += [v for act in ACTS for v in _norm_rope(act)]
    return list({v.name: v for v in out}.values())  # fp32's tiles are 16 rows whatever the rows asked
