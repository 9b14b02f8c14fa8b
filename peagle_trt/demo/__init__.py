"""Verb `demo` (`peagle-trt demo`): the main job, a trained pair served by tritonserver and measured
against its target alone; all of it, parser and handler included, is in cli.py."""

from peagle_trt.demo.cli import CODE_PAIR_K, SMOLLM2_K, code_pair, smollm2_head

__all__ = ["CODE_PAIR_K", "SMOLLM2_K", "code_pair", "smollm2_head"]
