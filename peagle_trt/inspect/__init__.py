"""Verb `inspect` (`peagle-trt inspect`): what a checkpoint is and whether a pair fits, read with
peagle_trt/checkpoint/'s loaders; its parser and handler are in cli.py."""
