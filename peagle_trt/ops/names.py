"""The one declaration of the custom ops' names, the ONNX domain and the TensorRT plugin identity.

Every other place reads these: the ONNX schemas and function bodies (`ops.onnx_defs`), the graph
writers (`peagle_trt/models/`, `peagle_trt/export/`), the TensorRT stage (`peagle_trt/engine/`).
The C++ plugins (plugins/src/plugins/peaglePlugins.h, pluginUtils.h) spell the same strings;
tests/plugins/test_plugin_names.py checks that they agree with this module.
"""

KV_ATTENTION = "PEagleKVAttention"
DRAFT_INPUTS = "PEagleDraftInputs"
DRAFT_SAMPLE = "PEagleDraftSample"
MOE = "PEagleMoE"  # the sparse MoE MLP of MoE targets (reference: ops/reference.py `moe`; peagle_trt/models/moe.py)
OP_TYPES = (KV_ATTENTION, DRAFT_INPUTS, DRAFT_SAMPLE, MOE)

DOMAIN = "peagle"  # ONNX domain of the custom nodes
DOMAIN_VERSION = 2  # its opset version (the schemas' since_version); 2: paged KV (block_tables)
PLUGIN_VERSION = "2"  # TensorRT plugin version: plugin name = op_type; 2: paged KV
PLUGIN_NAMESPACE = ""
