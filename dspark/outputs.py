"""Result objects returned by the engine and the offline API (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    spec_decode: dict | None = None
    new_token_ids: list[int] = field(default_factory=list)  # committed in this step
