"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, ...): Qwen3 attention (q/k norms, GQA) with
sparse MoE MLPs. Layer i is sparse unless i is in `mlp_only_layers` or (i + 1) is not a multiple
of `decoder_sparse_step` (transformers' rule); dense layers use `intermediate_size`, experts
`moe_intermediate_size` (`num_experts`, or `num_local_experts` as transformers 5 writes it).
Routing: softmax over all experts in float32, top-k, renormalised when
`norm_topk_prob`. The checkpoint's names (`mlp.experts.{e}.gate_proj.weight`, router
`mlp.gate.weight`) are ours; the per-expert linears are stacked on load (peagle_trt/checkpoint/experts.py)."""

from peagle_trt.architecture import MoEConfig
from peagle_trt.checkpoint.adapters.base import require
from peagle_trt.checkpoint.adapters.qwen3 import Qwen3Adapter
from peagle_trt.errors import ConfigError


class Qwen3MoeAdapter(Qwen3Adapter):
    name = "qwen3_moe"
    model_types = ("qwen3_moe",)

    def extra_fields(self, cfg: dict, where: str) -> dict:
        super().extra_fields(cfg, where)
        layers = int(require(cfg, "num_hidden_layers", where))
        # released configs say num_experts; transformers >= 5 writes num_local_experts
        experts = int(cfg.get("num_experts") or require(cfg, "num_local_experts", where))
        step = int(cfg.get("decoder_sparse_step", 1))
        if step < 1:
            raise ConfigError(f"{where}: decoder_sparse_step must be >= 1, got {step}")
        dense = set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers))
        if not any(sparse):
            return {}
        moe = MoEConfig(num_experts=experts, top_k=int(require(cfg, "num_experts_per_tok", where)),
                        intermediate_size=int(require(cfg, "moe_intermediate_size", where)),
                        routing="softmax_topk", norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
        return {"moe": moe, "moe_layers": sparse}
