"""OpenAI-compatible HTTP frontend next to tritonserver: `peagle-trt serve REPO --openai-port P`.

What: /v1/models, /v1/completions and /v1/chat/completions (SSE streaming or whole responses) on
FastAPI + uvicorn, forwarding every request to the Triton `peagle` model over its gRPC stream with
`peagle_trt.serve.client` (`AsyncGrpcStream`: the request/response code of `peagle-trt generate
--url`, on one shared asyncio channel), so both give the same tokens. Chat requests are
rendered with the target tokenizer's chat template found in the built repository. Speculative
statistics ride along as the extension field `speculative`.
Why: the tools that measure and use LLM servers (the `openai` client, AIPerf, harnesses) speak
this protocol; Triton's own OpenAI frontend is not part of the bundled tritonserver.
How to test: tests/serve/test_openai.py (a real tritonserver on loopback, the `openai` client,
httpx); load: `peagle-trt bench aiperf`.

Layout: protocol.py (request models, error shape), backend.py (Triton side), app.py (routes),
server.py (uvicorn on a thread: `OpenAIFrontend`, the one entry point).
"""

from peagle_trt.serve.openai_frontend.server import FrontendOptions, OpenAIFrontend

__all__ = ["FrontendOptions", "OpenAIFrontend"]
