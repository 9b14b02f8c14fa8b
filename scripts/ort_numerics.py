"""How far onnxruntime's FP8 Q/DQ and GEMM numerics are from the torch reference (and between ORT
releases): the measurements behind docs/EXPORT.md "Cross-backend numerics".

    python scripts/ort_numerics.py --save ort-A.npz        # op-level + end-to-end, JSON on stdout
    OTHER_VENV/bin/python scripts/ort_numerics.py --save ort-B.npz
    python scripts/ort_numerics.py --compare ort-A.npz ort-B.npz   # bitwise, release vs release

Op level (seeded data, opset-19 one-node graphs, one thread): DequantizeLinear of FP8 E4M3 weights,
QuantizeLinear -> DequantizeLinear of float32 activations (saturating, values near rounding ties
and beyond +-448 included), MatMul and Gemm(transB) against torch, and the exported Q/DQ-MatMul
pattern. End to end: the tiny FP8 llama pair of the tests (peagle_trt/tiny.py, ModelOpt, 4
calibration prompts), exported, teacher-forced along torch's greedy output: per-position logit
error and the top-2 logit margin where the argmax of the two backends differs; then each
backend's own greedy run and the first position where they part.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

FP8_MAX = 448.0
PROMPTS = ([3, 4, 5], list(range(40, 70)))


def _session(nodes, inputs, outputs, inits=(), qdq_fusion: bool = False) -> ort.InferenceSession:
    """One-thread CPU session; by default with the integer QDQ fusion off, as OrtExecutor runs."""
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    if not qdq_fusion:
        opts.add_session_config_entry("session.disable_quant_qdq", "1")
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _fp8_init(name: str, w: torch.Tensor) -> onnx.TensorProto:
    raw = w.contiguous().view(torch.uint8).numpy().tobytes()
    return helper.make_tensor(name, TensorProto.FLOAT8E4M3FN, list(w.shape), raw, raw=True)


def _diff(a, b) -> dict:
    a, b = torch.as_tensor(np.asarray(a)), torch.as_tensor(np.asarray(b))
    d = (a.double() - b.double()).abs()
    return {"max_abs": float(d.max()), "mismatches": int((a != b).sum()), "n": a.numel()}


def op_level(out: dict) -> dict:
    g = torch.Generator().manual_seed(0)
    f = TensorProto.FLOAT
    scale = np.float32(0.0123)
    w = (torch.randn(192, 576, generator=g) * 200).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # [in, out]
    x = torch.randn(64, 192, generator=g) * 3  # [rows, in]
    # activations near E4M3 rounding ties, and beyond the saturation bound
    grid = torch.tensor([v for v in np.arange(-FP8_MAX * 1.2, FP8_MAX * 1.2, 0.37)], dtype=torch.float32)
    acts = torch.cat([x.flatten(), grid * float(scale), torch.tensor([1e9, -1e9, 0.0]) * float(scale)])
    res = {}

    s = _session([helper.make_node("DequantizeLinear", ["w", "s"], ["y"])], [],
                 [helper.make_tensor_value_info("y", f, None)],
                 [_fp8_init("w", w), helper.make_tensor("s", f, [], [float(scale)])])
    y = s.run(None, {})[0]
    out["dq_weight"] = y
    res["DequantizeLinear fp8 weight"] = _diff(y, w.float() * torch.tensor(scale))

    zero = helper.make_tensor("z", TensorProto.FLOAT8E4M3FN, [], [0.0])
    sinit = helper.make_tensor("s", f, [], [float(scale)])
    s = _session([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
                  helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])],
                 [helper.make_tensor_value_info("x", f, None)], [helper.make_tensor_value_info("y", f, None)],
                 [sinit, zero])
    y = s.run(None, {"x": acts.numpy()})[0]
    out["qdq_act"] = y
    ref = ((acts / torch.tensor(scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
           * torch.tensor(scale))
    res["QuantizeLinear+DequantizeLinear fp32 activations"] = _diff(y, ref)

    xq = torch.from_numpy(out["qdq_act"][: x.numel()].reshape(x.shape))  # [64, 192]
    wd = torch.from_numpy(out["dq_weight"])  # [192, 576]
    s = _session([helper.make_node("MatMul", ["a", "b"], ["y"])],
                 [helper.make_tensor_value_info("a", f, None), helper.make_tensor_value_info("b", f, None)],
                 [helper.make_tensor_value_info("y", f, None)])
    y = s.run(None, {"a": xq.numpy(), "b": wd.numpy()})[0]
    out["matmul"] = y
    torch.set_num_threads(1)
    ref = xq @ wd
    res["MatMul fp32 [64,192]x[192,576]"] = {**_diff(y, ref), "max_rel": float(((torch.from_numpy(y) - ref).abs()
                                                                               / ref.abs().clamp_min(1)).max())}
    s = _session([helper.make_node("Gemm", ["a", "b"], ["y"], transB=1)],
                 [helper.make_tensor_value_info("a", f, None), helper.make_tensor_value_info("b", f, None)],
                 [helper.make_tensor_value_info("y", f, None)])
    y = s.run(None, {"a": xq.numpy(), "b": wd.t().contiguous().numpy()})[0]
    out["gemm"] = y
    res["Gemm transB fp32"] = _diff(y, ref)

    pattern = ([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
                helper.make_node("DequantizeLinear", ["q", "s", "z"], ["xq"]),
                helper.make_node("DequantizeLinear", ["w", "ws"], ["wd"]),
                helper.make_node("MatMul", ["xq", "wd"], ["y"])],
               [helper.make_tensor_value_info("x", f, None)], [helper.make_tensor_value_info("y", f, None)],
               [sinit, zero, _fp8_init("w", w), helper.make_tensor("ws", f, [], [float(scale)])])
    y = _session(*pattern).run(None, {"x": x.numpy()})[0]
    out["qdq_matmul"] = y
    res["exported pattern Q/DQ(x) @ DQ(w)"] = _diff(y, xq @ wd)
    try:  # onnxruntime's default optimizations include the integer QDQ fusion
        y = _session(*pattern, qdq_fusion=True).run(None, {"x": x.numpy()})[0]
        res["exported pattern, QDQ fusion on"] = _diff(y, xq @ wd)
    except Exception as exc:  # noqa: BLE001 -- recorded: which releases reject the fused graph
        res["exported pattern, QDQ fusion on"] = {"error": str(exc).splitlines()[0][-160:]}
    return res


def end_to_end(out: dict) -> dict:
    from peagle_trt.checkpoint import load_pair
    from peagle_trt.config import SamplingParams, SpecConfig
    from peagle_trt.executors.onnxruntime import OrtExecutor
    from peagle_trt.executors.torch import TorchExecutor
    from peagle_trt.export import ExportOptions, export_models
    from peagle_trt.quantize import QuantizeOptions, quantize_target
    from peagle_trt.runtime.scheduler import generate
    from peagle_trt.speculative.decoder import SpecDecoder
    from peagle_trt.tiny import make_all

    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tiny = make_all(root / "tiny")
        quantize_target(tiny["llama"], root / "fp8", QuantizeOptions(num_calib=4), progress=None)
        spec = SpecConfig("peagle", 3)
        target, drafter = load_pair(root / "fp8", tiny["aws"], spec).build()
        export_models(target, drafter, root / "export", ExportOptions(spec, 2, 100))
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            ref = generate(SpecDecoder(TorchExecutor(target, drafter, 2, 104), spec), prompt, params).output
            got = generate(SpecDecoder(OrtExecutor(root / "export"), spec), prompt, params).output
            seq = torch.tensor([prompt + ref[:-1]])  # [1, T] teacher-forced along torch's greedy output
            pos = torch.arange(seq.shape[1])[None]
            a = TorchExecutor(target, None, 1, 104).target(seq, pos, torch.tensor([0]))[0][0, len(prompt) - 1:]
            b = OrtExecutor(root / "export").target(seq, pos, torch.tensor([0]))[0][0, len(prompt) - 1:]
            out[f"logits_{i}"] = b.numpy()  # [30, V]
            top2 = a.topk(2, dim=-1).values  # [30, 2]
            margin = top2[:, 0] - top2[:, 1]
            err = (a - b).abs().amax(-1)  # [30]
            flips = (a.argmax(-1) != b.argmax(-1)).nonzero().flatten().tolist()
            first = next((j for j, (u, v) in enumerate(zip(ref, got)) if u != v), None)
            res[f"prompt {i} (len {len(prompt)})"] = {
                "max_abs_logit_error": float(err.max()), "median_abs_logit_error": float(err.median()),
                "logit_range": [float(a.min()), float(a.max())],
                "min_top2_margin": float(margin.min()),
                "argmax_flips_teacher_forced": [{"pos": j, "margin": float(margin[j]), "error": float(err[j])}
                                                for j in flips],
                "greedy_first_divergence": first,
                "margin_at_divergence": float(margin[first]) if first is not None else None}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", type=Path, help="write the raw onnxruntime outputs here (.npz)")
    ap.add_argument("--compare", nargs=2, type=Path, help="bitwise comparison of two --save files")
    args = ap.parse_args()
    if args.compare:
        a, b = (np.load(p) for p in args.compare)
        print(json.dumps({k: _diff(a[k], b[k]) for k in sorted(a.files) if k in b.files}, indent=1))
        return
    raw: dict = {}
    result = {"onnxruntime": ort.__version__, "torch": torch.__version__,
              "op_level": op_level(raw), "end_to_end": end_to_end(raw)}
    if args.save:
        np.savez(args.save, **raw)
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
