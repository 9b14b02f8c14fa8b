"""Stage `export` (`peagle-trt export`): the target and drafter as ONNX graphs with `peagle` plugin
nodes (contract: docs/EXPORT.md).

run.py writes an export directory (atomic, with manifest.json); graphs.py, moe.py, sandwich.py and
builder.py write the graphs node by node.
"""

from peagle_trt.export.run import ExportOptions, export_models, export_pair, save

__all__ = ["ExportOptions", "export_models", "export_pair", "save"]
