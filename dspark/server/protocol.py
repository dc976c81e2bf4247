"""OpenAI-compatible request and response models (pydantic v2).

Requests are strict (`"1"` is not an integer, `1` is not a boolean) and forbid unknown
fields, so a typo is a 400 that names the field instead of a silently ignored option.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dspark.outputs import RequestOutput
from dspark.sampling_params import SamplingParams


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(StrictModel):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    user: str | None = None
    # extensions (vLLM spelling)
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    cache_salt: str | None = None

    def effective_max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self) -> SamplingParams:
        """Raises ValueError naming the field (from SamplingParams)."""
        if self.n not in (None, 1):
            raise ValueError(f"n: only n=1 is supported, got {self.n}")
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            max_tokens=self.effective_max_tokens(),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=bool(self.ignore_eos),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError("prompt: only one prompt per request is supported")
            p = p[0]
        if isinstance(p, list) and not p:
            raise ValueError("prompt: must not be empty")
        return p


class TextContent(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContent] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool | None = True

    def effective_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


# ------------------------------------------------------------------------- responses


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    spec_decode: dict[str, Any] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    spec_decode: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """A streamed chat chunk. The usage chunk has no choices and carries spec_decode."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    spec_decode: dict[str, Any] | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    spec_decode: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "dspark"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
    503: "service_unavailable",
}  # fmt: skip


def error_body(status: int, message: str, param: str | None = None, code=None) -> dict:
    """An OpenAI-style error body: {"error": {"message", "type", "param", "code"}}."""
    err = ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "error"), param=param,
                    code=code if code is not None else status)  # fmt: skip
    return ErrorResponse(error=err).model_dump()


def sse(obj: BaseModel | dict) -> str:
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


def usage_of(out: RequestOutput) -> UsageInfo:
    n_in, n_out = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return UsageInfo(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out)


class TextDelta:
    """Incremental text of a cumulative output. While running, the tail that might still
    change is held back: an incomplete UTF-8 character and, with stop strings, the last
    (longest stop - 1) characters (they might become the start of a stop string)."""

    def __init__(self, stops: list[str]):
        self.sent = ""
        self.hold = max((len(s) for s in stops), default=1) - 1

    def __call__(self, out: RequestOutput) -> str:
        text = out.outputs[0].text
        if not out.finished:
            text = text[: len(text) - self.hold].rstrip("\ufffd")
            if not text.startswith(self.sent):
                return ""
        delta = text[len(self.sent) :]
        self.sent += delta
        return delta


# ------------------------------------------------------------------------- validation errors

_UNION_HINTS = {
    "prompt": "must be a string, a list of token ids, or a one-element list of either",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of {'type': 'text', 'text': ...} parts",
}


def _loc_path(loc: tuple) -> list[str]:
    parts = []
    for p in loc:
        if isinstance(p, int):
            parts.append(str(p))
        elif p.isidentifier() and p not in ("str", "int", "float", "bool", "list", "dict"):
            if not p[:1].isupper():  # union member tags are class names
                parts.append(p)
    return parts


def describe_validation_error(err: ValidationError) -> tuple[str, str | None]:
    """(message, param) for the first problem of a request body."""
    errors = err.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first["msg"])
        return f"malformed JSON body: {detail}", None
    path = _loc_path(first["loc"])
    if not path:
        return f"request body: {first['msg']}", None
    field = ".".join(path)
    same = [e for e in errors if _loc_path(e["loc"])[: len(path)] == path]
    if first["type"] == "extra_forbidden":
        msg = f"{field}: unknown field (not supported by this server)"
    elif first["type"] == "missing":
        msg = f"{field}: field required"
    elif len(same) > 1 and path[-1] in _UNION_HINTS:
        msg = f"{field}: {_UNION_HINTS[path[-1]]}"
    else:
        msg = f"{field}: {first['msg']}"
    return msg, path[0]
