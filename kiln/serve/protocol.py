"""The OpenAI wire format `kiln serve` speaks: request models (pydantic, strict: an unknown or out-of-range field is a
400 naming it), the error body, and the response / stream-chunk builders.

Requests are checked here for shape and range; what needs the model (the vocabulary, the context length, the chat
template) is checked in app.py. Fields kiln adds beyond OpenAI's (top_k, min_p, repetition_penalty, ignore_eos) are the
ones vLLM adds under the same names, so clients that pass them as `extra_body` work against either.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kiln.engine.params import MAX_TOP_LOGPROBS

# fields clients send that change nothing here (bookkeeping on OpenAI's side)
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                  "safety_identifier")
MAX_N = 64


class RequestError(Exception):
    """A request the server refuses: its HTTP status, message, and the field at fault (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _member(p: str) -> bool:
    """Whether a pydantic location part names a union's member (`str`, `list[...]`), which is no field of the request."""
    return p in ("str", "int") or p.startswith(("list[", "dict[", "tuple["))


def error_from_validation(e: ValidationError) -> RequestError:
    """The first pydantic error as OpenAI's error: `param` is the dotted path of the field (messages.0.role)."""
    errors = e.errors()
    err = errors[0]
    last = err["loc"][-1] if err["loc"] else None
    if isinstance(last, str) and _member(last):  # a union's member failed: of its members' errors, the one reaching
        # deepest into the request (a bad part of a list of content parts, not "content: a valid string")
        err = max((x for x in errors if x["loc"][:len(err["loc"]) - 1] == err["loc"][:-1]), key=lambda x: len(x["loc"]))
    raw, tags = list(err["loc"]), set()
    for k, p in enumerate(raw):  # a tagged union's member is named by its tag value, which is no field of the request
        if isinstance(p, str) and "tagged-union[" in p:
            tags.add(k + (2 if p.startswith("list[") else 1))
    raw = [p for k, p in enumerate(raw) if k not in tags]
    loc = [str(p) for p in raw if not (isinstance(p, str) and p.startswith(("function-", "union[", "tagged-union[")))]
    # a union's member names (`str`, `list[...]`) are pydantic's, not the request's
    loc = [p for p in loc if not _member(p)]
    param = ".".join(loc) or None
    message = err["msg"]
    if err["type"] == "extra_forbidden":
        message = f"unrecognized request argument: {param}"
    elif err["type"] == "missing":
        message = f"missing required argument: {param}"
    else:
        message = f"{param}: {message}" if param else message
    return RequestError(message, param)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionSpec(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's wire form)


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str = Field(min_length=1)  # a data: URL (kiln.serve.images); fetching a web address is refused
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor sets the resolution


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[ContentPart | ImagePart, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    # what an assistant message of a response carries back when a client appends it as it came; not rendered
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """What chat and completions requests share."""
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # vLLM's extensions, same names
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False
    # OpenAI bookkeeping; accepted, unused
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("a stop sequence is empty")
        return stops

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        if v is not None and v.get("type") != "text":
            raise ValueError(f"only {{'type': 'text'}} is served, got type {v.get('type')!r}")
        return v


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("insertion (suffix) is not served")
        return v


def parse(model: type[BaseModel], body: bytes) -> Any:
    """The request body as `model`, or a RequestError naming the field."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise error_from_validation(e) from None


# ---- responses ---------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


SSE_DONE = sse("[DONE]")
