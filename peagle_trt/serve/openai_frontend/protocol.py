"""OpenAI request bodies (pydantic, unknown fields refused) and the response / error objects.

Supported: `model`, `messages` | `prompt`, `max_tokens` / `max_completion_tokens`, `temperature`,
`top_p`, `seed`, `stop`, `n` (1 only), `stream`, `stream_options.include_usage`,
`response_format` (text, json_object, json_schema), and the vLLM-style extensions `top_k`,
`ignore_eos`, `return_token_ids`, `structured_outputs` (exactly one of json, regex, choice,
grammar, json_object: config.py `StructuredOutput`). vLLM's removed `guided_*` keys are refused
with their replacement. OpenAI fields that this server does not implement are accepted only at their
neutral value (e.g. `presence_penalty=0`, `logprobs=false`) and refused otherwise, so a client never
gets silently different behaviour. Tested in tests/serve/test_openai.py.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from peagle_trt.config import SamplingParams, StructuredOutput
from peagle_trt.errors import RequestError

__all__ = ["ChatRequest", "CompletionRequest", "ValidationError", "error_body", "new_id"]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


# vLLM's request keys for structured output before 0.12 (since removed there): refused, not ignored
REMOVED = {"guided_json": 'structured_outputs: {"json": SCHEMA} or response_format json_schema',
           "guided_regex": 'structured_outputs: {"regex": PATTERN}',
           "guided_choice": 'structured_outputs: {"choice": [STRINGS]}',
           "guided_grammar": 'structured_outputs: {"grammar": EBNF}',
           "guided_decoding_backend": "nothing: this server compiles grammars with xgrammar; leave it out",
           "guided_whitespace_pattern": "nothing: JSON comes without free whitespace; leave it out"}


def refuse_removed_keys(body: dict) -> None:
    """RequestError naming the replacement of a removed key, before anything else reads the body."""
    for key, instead in REMOVED.items():
        if key in body:
            raise RequestError(f"{key} was removed (as in vLLM 0.12); send {instead}")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise RequestError("response_format json_schema needs json_schema: {name, schema}")
        return StructuredOutput.from_dict({"json": self.json_schema.schema_})


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # extension (vLLM): 0 or -1 disables
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension (vLLM): generate exactly max_tokens
    return_token_ids: bool = False  # extension (vLLM): the generated ids in each choice / chunk
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None  # extension (vLLM): one of json, regex, choice, grammar, json_object
    user: str | None = None  # accepted, not used
    # OpenAI fields accepted only at their neutral value:
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None

    def check_unsupported(self) -> None:
        if self.n != 1:
            raise RequestError(f"n={self.n} is not supported; this server returns one choice (n=1)")
        if self.presence_penalty or self.frequency_penalty:
            raise RequestError("presence_penalty / frequency_penalty are not supported; send 0 or leave them out")
        if self.logit_bias:
            raise RequestError("logit_bias is not supported; leave it out")
        if self.logprobs not in (None, False, 0):
            raise RequestError("logprobs are not supported; leave `logprobs` out")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise RequestError("stream_options.continuous_usage_stats is not supported; usage comes in the last "
                              "chunk (include_usage)")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream=true")
        if self.stop is not None and len(self.stop_list) > 4:
            raise RequestError(f"at most 4 stop sequences, got {len(self.stop_list)}")

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def structured(self) -> StructuredOutput | None:
        """The grammar the output must follow: response_format or structured_outputs (not both)."""
        fmt = self.response_format.structured() if self.response_format is not None else None
        if fmt is not None and self.structured_outputs is not None:
            raise RequestError("send response_format or structured_outputs, not both")
        return StructuredOutput.from_dict(self.structured_outputs) if self.structured_outputs is not None else fmt

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=max(self.top_k, 0), seed=self.seed, ignore_eos=self.ignore_eos,
                              stop=self.stop_list, structured=self.structured())


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs:
            raise RequestError("top_logprobs is not supported; leave it out")
        if self.tools or self.tool_choice not in (None, "none"):
            raise RequestError("tools / tool_choice are not supported by this server")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise RequestError(f"max_tokens={self.max_tokens} and max_completion_tokens="
                              f"{self.max_completion_tokens} disagree; send one of them")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1)  # the OpenAI default for completions
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise RequestError(f"prompt must be one string (or a list of one), got a list of {len(self.prompt)}")
        if self.echo or self.suffix:
            raise RequestError("echo / suffix are not supported; leave them out")
        if self.best_of not in (None, 1):
            raise RequestError(f"best_of={self.best_of} is not supported (only 1)")

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """A pydantic error -> (one readable message, the first offending parameter)."""
    parts, param = [], None
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        param = param or loc
        shown = err["type"] != "missing" and not isinstance(err.get("input"), dict)
        got = f" (got {err['input']!r})" if shown else ""
        if err["type"] == "extra_forbidden":
            parts.append(f"{loc}: unknown parameter; remove it")
        else:
            parts.append(f"{loc}: {err['msg']}{got}")
    return "; ".join(parts), param
