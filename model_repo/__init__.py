"""The Triton repository templates (see README.md here), installed as `peagle_trt.model_repo`."""
