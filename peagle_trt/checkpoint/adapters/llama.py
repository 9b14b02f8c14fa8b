"""Llama (2, 3, 3.1 with llama3 rope scaling, ...): the base adapter as is."""

from peagle_trt.checkpoint.adapters.base import TargetAdapter


class LlamaAdapter(TargetAdapter):
    name = "llama"
    model_types = ("llama",)
