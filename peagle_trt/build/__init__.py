"""Stage `build` (`peagle-trt build`, parsed and handled in cli.py): a ready Triton model repository
from a checkpoint pair.

peagle_trt/build/repository.py renders it (atomic, with manifest.json); its settings, `RepositoryOptions`, and their
round trip through config.pbtxt live in peagle_trt/serve/options.py, beside their reader.
"""

from peagle_trt.build.repository import build_repository, kv_memory_of, templates_dir
from peagle_trt.serve.options import (
                                           ArtifactPaths,
                                           RepositoryOptions,
                                           from_parameters,
                                           read_options,
                                           read_parameters,
                                           to_parameters,
)

__all__ = ["ArtifactPaths", "RepositoryOptions", "build_repository", "from_parameters", "read_options",
           "read_parameters", "kv_memory_of", "templates_dir", "to_parameters"]
