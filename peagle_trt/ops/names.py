"""The one declaration of the custom ops' names, the ONNX domain and the TensorRT plugin identity.

Every other place reads these: the ONNX schemas and function bodies (`ops.onnx_defs`), the graph
writers (`peagle_trt/models/`, `peagle_trt/export/`), the TensorRT stage (`peagle_trt/engine/`).
The C++ plugins (plugins/src/plugins/peaglePlugins.h, pluginUtils.h) spell the same strings;
tests/plugins/test_plugin_names.py checks that they agree with this module.
"""

KV_ATTENTION = "PEagleKVAttention"
DRAFT_INPUTS = "PEagleDraftInputs"
DRAFT_SAMPLE = "PEagleDraftSample"
OP_TYPES = (KV_ATTENTION, DRAFT_INPUTS, DRAFT_SAMPLE)

DOMAIN = "peagle"  # ONNX domain of the custom nodes
DOMAIN_VERSION = 1  # its opset version (the schemas' since_version)
PLUGIN_VERSION = "1"  # TensorRT plugin version: plugin name = op_type
PLUGIN_NAMESPACE = ""
