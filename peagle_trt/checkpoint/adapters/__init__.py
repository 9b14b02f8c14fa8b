"""One adapter per target family (config.json `model_type`): base.py (the Llama parsing every
family extends), one module per family, registry.py (`adapter_for`)."""

from peagle_trt.checkpoint.adapters.base import TargetAdapter
from peagle_trt.checkpoint.adapters.registry import ADAPTERS, adapter_for

__all__ = ["ADAPTERS", "TargetAdapter", "adapter_for"]
