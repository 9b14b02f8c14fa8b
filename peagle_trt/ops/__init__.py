"""The P-EAGLE custom ops, each kept in three views with one contract:

  torch   `peagle::*` ops (`ops.reference`): the real CPU (and generic CUDA) reference, used by
          the torch executor at run time and by every test;
  ONNX    custom nodes in domain `peagle` with a registered `OpSchema` and a model-local
          FunctionProto holding the same math in standard ONNX ops (`ops.onnx_defs`), so
          onnxruntime runs the exported file as is; `ops.onnx_builder` is the node builder
          every ONNX writer uses;
  plugin  TensorRT IPluginV3 plugins in plugins/ whose names equal the ONNX op_types.

The lowest layer of the package: it imports nothing from peagle_trt but `errors`. Op names,
domain and plugin version/namespace are declared once, in `ops.names`.

| op_type            | what                                                                 |
|--------------------|----------------------------------------------------------------------|
| PEagleKVAttention  | attention of a few new rows per request over its paged KV cache (block   |
|                    | tables), causal by absolute position, writing the new K/V in place      |
| PEagleDraftInputs  | the drafter's input rows for a batch: pending real rows + K-1 mask rows, |
|                    | their embeddings, hidden states and positions                           |
| PEagleDraftSample  | greedy argmax over the draft vocabulary + d2t mapping to target ids  |
| PEagleMoE          | a sparse mixture-of-experts MLP: routing, the routed experts' gated  |
|                    | MLPs (bf16 / fp16 / fp32 or FP8 weights), the router-weighted sum      |
"""

from peagle_trt.ops.names import (
                                  DOMAIN,
                                  DOMAIN_VERSION,
                                  DRAFT_INPUTS,
                                  DRAFT_SAMPLE,
                                  KV_ATTENTION,
                                  MOE,
                                  OP_TYPES,
                                  PLUGIN_NAMESPACE,
                                  PLUGIN_VERSION,
)
from peagle_trt.ops.reference import draft_inputs, draft_sample, kv_attention, moe

__all__ = ["DOMAIN", "DOMAIN_VERSION", "DRAFT_INPUTS", "DRAFT_SAMPLE", "KV_ATTENTION", "MOE", "OP_TYPES",
           "PLUGIN_NAMESPACE", "PLUGIN_VERSION", "draft_inputs", "draft_sample", "kv_attention", "moe"]
