"""What the engine returns for a request: RequestOutput, one CompletionOutput per completion."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with SamplingParams.prompt_logprobs
    token_times: list[float] | None = None  # once finished: when each output token was sampled (time.time())
