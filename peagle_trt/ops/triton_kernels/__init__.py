"""The three P-EAGLE ops written once in Triton (the kernel language): one module per op, each a
`@triton.jit` kernel plus a launcher with the signature of `peagle_trt.ops.reference`.

They run under the Triton interpreter on CPU tensors (TRITON_INTERPRET=1, tests/ops/test_triton_kernels.py),
JIT on CUDA tensors (`peagle_trt.ops.kernels`), and compile ahead of time to sm_90a / sm_100a cubins
for the TensorRT plugins (`peagle_trt.ops.triton_kernels.aot`). `triton` is imported lazily by the
modules that need it, never here.
"""
