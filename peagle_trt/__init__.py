"""peagle-trt: serve P-EAGLE (parallel EAGLE) speculative decoding with TensorRT and Triton.

Stages live in subpackages named for their CLI verb (`checkpoint`, `export`, `engine`, `quantize`,
`repository` for `build`, `train`); the console script is `peagle-trt` (cli.py).
"""

__version__ = "0.1.0"
