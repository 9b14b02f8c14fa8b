"""Verb `make-tiny` (`peagle-trt make-tiny`): small seeded checkpoints in the real layouts, for tests and
the CPU demo (checkpoints.py); the verb's parser and handler are in cli.py."""

from peagle_trt.make_tiny.checkpoints import (
    CORPUS,
    MASK_TOKEN,
    make_all,
    make_drafter,
    make_families,
    make_target,
    make_tokenizer,
)

__all__ = ["CORPUS", "MASK_TOKEN", "make_all", "make_drafter", "make_families", "make_target", "make_tokenizer"]
