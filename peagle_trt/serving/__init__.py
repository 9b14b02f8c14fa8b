"""Serving: the engine behind the Triton model (`engine.TextGenerator`), the Triton Python model
itself (`triton_model`), the server launcher (`server`) and the gRPC streaming client (`client`)."""
