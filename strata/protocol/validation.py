"""validate_request: the one check of a request against the model's limits.

The offline API and the engine process (LLMEngine.validate) and the server's front end (before it
sends a request to the engine) all call it, so a limit is written once. The engine adds only what
needs the engine itself (tensor parallelism, compiling a grammar against the tokenizer).

The rules:
1. the sampling parameters: SamplingParams.validate (ranges, and logprobs and stop_token_ids
   within the vocabulary);
2. every prompt is non-empty and its token ids are in [0, vocab_size);
3. every prompt leaves room in the context: the engine needs room for one new token (a completion
   stops at max_model_len, finish_reason "length"); the HTTP API (`api=True`) needs room for
   max_tokens of them, and refuses what would be cut short.

The wording differs by caller, as it always has: the engine's errors name the request's index in
a batch ("request 2: ..."), the API's name the field (`param`) and the prompt's position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from strata.errors import RequestError
from strata.protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: the model's vocabulary and context length."""

    vocab_size: int
    max_model_len: int

    @classmethod
    def from_info(cls, info: dict) -> ModelLimits:
        """From the engine's ready message (server/engine_proc.py's `info`)."""
        return cls(info["vocab_size"], info["max_model_len"])


def validate_request(params: SamplingParams, limits: ModelLimits, prompts: Sequence[Sequence[int]] | None = None,
                     *, index: int = 0, api: bool = False, ids_from_client: Sequence[bool] | None = None) -> None:
    """Raise RequestError for the first rule `params` and `prompts` break (the rules: module docstring).

    prompts None: the parameters only (the server checks them so before it spends time tokenizing,
    then calls again with the prompts). index: the request's index in a batch (engine wording).
    api: the HTTP API's rules and wording. ids_from_client (api): per prompt, whether its ids came
    from the client (checked against the vocabulary) or from the checkpoint's tokenizer (default:
    all from the client); the engine checks every id it is given.
    """
    params.validate(index, limits.vocab_size)
    if prompts is None:
        return
    if api:
        _api_prompts(prompts, params, limits, ids_from_client)
        return
    for ids in prompts:
        _engine_prompt(index, ids, limits)


def _in_vocab(ids: Sequence[int], vocab: int) -> bool:
    return not ids or (min(ids) >= 0 and max(ids) < vocab)


def _engine_prompt(index: int, ids: Sequence[int], limits: ModelLimits) -> None:
    if not ids:
        raise RequestError(f"request {index}: prompt is empty; give at least one token")
    if len(ids) >= limits.max_model_len:
        raise RequestError(
            f"request {index}: prompt has {len(ids)} tokens but max_model_len is "
            f"{limits.max_model_len} (room for at least one new token is needed); shorten the "
            "prompt or raise max_model_len"
        )
    if not _in_vocab(ids, limits.vocab_size):
        raise RequestError(f"request {index}: prompt token ids must be in [0, {limits.vocab_size})")


def _api_prompts(prompts: Sequence[Sequence[int]], params: SamplingParams, limits: ModelLimits,
                 ids_from_client: Sequence[bool] | None) -> None:
    vocab = limits.vocab_size
    for i, ids in enumerate(prompts):
        if (ids_from_client is None or ids_from_client[i]) and not _in_vocab(ids, vocab):
            raise RequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
    max_tokens = params.max_tokens
    for i, ids in enumerate(prompts):
        if not ids:
            raise RequestError("prompt is empty; give at least one token", param="prompt")
        want = len(ids) + (max_tokens or 1)
        if want > limits.max_model_len:
            where = f"prompt {i} " if i else "the prompt "
            raise RequestError(
                f"{where}has {len(ids)} tokens and max_tokens is {max_tokens or 1}: {want} tokens exceed the "
                f"model's context length ({limits.max_model_len}); shorten the prompt or lower max_tokens",
                param="max_tokens" if max_tokens else "prompt",
            )
