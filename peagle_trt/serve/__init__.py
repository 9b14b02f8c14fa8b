"""Stage `serve` (`peagle-trt serve`, parsed and handled in cli.py): a built repository served. The
text generator over the scheduler behind every generate path (`generator.TextGenerator`), its typed
settings as config.pbtxt carries them (`options`), the wire contract (`protocol`), the Triton Python
model (`triton_model`), the server launcher (`server`), the gRPC streaming client (`client`) and the
OpenAI-compatible frontend (`openai_frontend/`)."""
