"""Serving a built repository: the text generator over the scheduler behind every generate path
(`generator.TextGenerator`), its typed settings as config.pbtxt carries them (`options`), the
wire contract (`protocol`), the Triton Python model (`triton_model`), the server launcher
(`server`) and the gRPC streaming client (`client`)."""
