"""Runtime: the in-flight scheduler (scheduler.py) above the speculative step (peagle_trt/speculative/)."""
