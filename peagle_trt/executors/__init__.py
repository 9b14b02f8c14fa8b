"""Executors: the model forwards behind the `Executor` interface of peagle_trt/speculative/executor.py.

torch.py (the reference models, CPU / CUDA, with the kernels option), onnxruntime.py (an export
directory), tensorrt.py (TensorRT plans). Import the one you need: each pulls in its own runtime.
"""
