"""Requests and their sequences (one per completion); what the engine returns for them is
strata/protocol/outputs.py (RequestOutput), which the server's front end reads too."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from strata.protocol.lora import LoRARequest
from strata.protocol.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV parked in the host pool
    FINISHED = "finished"


class Sequence:
    """One completion: the tokens so far, how many have KV in the cache, and its blocks."""

    def __init__(self, seq_id: int, request: Request, index: int, token_ids: list[int]) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index  # completion index within the request (0..n-1)
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.host_blocks: list[int] = []  # while swapped out: where its KV waits in host memory
        self.block_hashes: list[int] = []  # prefix-hash chain of the full blocks (memory/blocks.py)
        # what the KV depends on beyond the tokens: the LoRA adapter (None: the base model's KV)
        self.cache_salt = ("lora", request.lora_id) if request.lora_id else None
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at last admission
        self.status = SeqStatus.WAITING
        self.logprobs: list[dict[int, float]] = []
        self.output_text: Any = None  # protocol/output_text.OutputText when the engine detokenises
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.grammar: Any = None  # structured output: an llguidance matcher following the output

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id}, {self.status.value}, {self.num_computed_tokens}/{self.num_tokens})"


@dataclass
class Timeline:
    """Wall-clock stamps of a request's life (time.time()); the only clock metrics read."""

    arrival: float = field(default_factory=time.time)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    tokenized: float | None = None  # set by front ends that tokenize (the server)
    token_times: list[float] = field(default_factory=list)  # one stamp per sampled token


class Request:
    def __init__(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.lora_request = lora_request
        self.lora_id = lora_request.lora_int_id if lora_request is not None else 0  # 0: the base model
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.timeline = Timeline()
        self.seqs: list[Sequence] = []
        self.forked = params.n == 1
        # prompt_logprobs: one entry per prompt token computed so far (the first token has none)
        self.prompt_logprobs: list[dict[int, float] | None] | None = None if params.prompt_logprobs is None else [None]

    @property
    def finished(self) -> bool:
        return self.forked and all(s.finished for s in self.seqs)
