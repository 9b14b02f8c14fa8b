"""A small ONNX node builder: `b.op("MatMul", x, w)` returns the output name, constants become
Constant nodes (valid in graphs and function bodies alike), weights become initializers."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class Builder:
    def __init__(self, prefix: str = ""):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._ids = itertools.count()
        self.prefix = prefix

    def name(self, hint: str) -> str:
        return f"{self.prefix}{hint}_{next(self._ids)}"

    def op(self, op_type: str, *inputs: str, outputs: int | list[str] = 1, domain: str = "",
           name: str | None = None, **attrs):
        """Add a node; returns its output name (or a list of names when it has several)."""
        outs = outputs if isinstance(outputs, list) else [self.name(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name or self.name(op_type),
                                           domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def const(self, value, dtype=None) -> str:
        arr = np.asarray(value, dtype=dtype)
        return self.op("Constant", value=numpy_helper.from_array(arr, self.name("const")))

    def ints(self, *values: int) -> str:
        return self.const(np.array(values, dtype=np.int64))

    def weight(self, name: str, array: np.ndarray | onnx.TensorProto) -> str:
        tensor = array if isinstance(array, onnx.TensorProto) else numpy_helper.from_array(array, name)
        tensor.name = name
        self.initializers.append(tensor)
        return name

    def fp8_weight(self, name: str, values_f32: np.ndarray) -> str:
        """A FLOAT8E4M3FN initializer from float32 values already representable in E4M3."""
        tensor = helper.make_tensor(name, TensorProto.FLOAT8E4M3FN, values_f32.shape,
                                    values_f32.astype(np.float32).flatten().tolist())
        self.initializers.append(tensor)
        return name

    # -- common blocks ---------------------------------------------------------------------------
    def rmsnorm(self, x: str, weight: str | None, eps: float) -> str:
        """RMSNorm over the last axis; weight None: scale-free (Gemma-4's v norm)."""
        var = self.op("ReduceMean", self.op("Mul", x, x), self.ints(-1), keepdims=1)
        inv = self.op("Reciprocal", self.op("Sqrt", self.op("Add", var, self.const(np.float32(eps)))))
        normed = self.op("Mul", x, inv)
        return normed if weight is None else self.op("Mul", normed, weight)

    def silu(self, x: str) -> str:
        return self.op("Mul", x, self.op("Sigmoid", x))

    def gelu_tanh(self, x: str, dtype=np.float32) -> str:
        """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (opset 19 has no Gelu)."""
        c = lambda v: self.const(np.asarray(v, dtype=dtype))  # noqa: E731
        cube = self.op("Mul", x, self.op("Mul", x, x))
        inner = self.op("Mul", c(np.sqrt(2 / np.pi)), self.op("Add", x, self.op("Mul", c(0.044715), cube)))
        return self.op("Mul", self.op("Mul", c(0.5), x), self.op("Add", c(1.0), self.op("Tanh", inner)))
