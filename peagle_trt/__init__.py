"""peagle-trt: serve P-EAGLE (parallel EAGLE) speculative decoding with TensorRT and Triton.

Stages live in subpackages (`checkpoint`, `models`, `spec`, ...); the console script is `peagle-trt`.
"""

__version__ = "0.1.0"
