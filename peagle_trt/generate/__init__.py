"""Verb `generate` (`peagle-trt generate`): its parser and handler are in cli.py."""
