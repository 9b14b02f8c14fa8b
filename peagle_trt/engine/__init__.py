"""Stage `engine` (`peagle-trt engine`): TensorRT plans from an export directory's TensorRT graphs.

build.py builds them (profiles, plugin loading, manifest); cli.py is the subcommand.
"""

from peagle_trt.engine.build import (
                                     ARCHES,
                                     GRAPHS,
                                     PLUGIN_OPS,
                                     EngineOptions,
                                     build_engines,
                                     import_tensorrt,
                                     load_plugins,
                                     profiles_for,
                                     visible_gpu,
)

__all__ = ["ARCHES", "GRAPHS", "PLUGIN_OPS", "EngineOptions", "build_engines", "import_tensorrt",
           "load_plugins", "profiles_for", "visible_gpu"]
