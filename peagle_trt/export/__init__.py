"""Stage `export` (`peagle-trt export`): the target and drafter as ONNX graphs with `peagle` plugin
nodes (contract: docs/EXPORT.md).

run.py writes an export directory (atomic, with manifest.json); graphs.py assembles the graphs, each
layer writing its own nodes (`write_onnx` beside its torch forward in peagle_trt/models/), with the
node builder of peagle_trt/ops/onnx_builder.py.
"""

from peagle_trt.export.run import ExportOptions, export_models, export_pair, save

__all__ = ["ExportOptions", "export_models", "export_pair", "save"]
