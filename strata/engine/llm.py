"""The offline API, shaped like vLLM's: LLM(model=...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from strata.config import EngineConfig
from strata.engine.llm_engine import LLMEngine
from strata.engine.llm_kwargs import engine_kwargs
from strata.errors import RequestError
from strata.protocol.lora import LoRARequest
from strata.protocol.outputs import RequestOutput
from strata.protocol.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """Load a model once; generate for batches of prompts with continuous batching."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """kwargs: EngineConfig's fields, and vLLM's names for them (engine/llm_kwargs.py)."""
        # offline: no decode-first cap unless asked for (platform/base.start_up_cap says why)
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs(model, kwargs)), workload="offline")
        self._counter = 0

    def close(self) -> None:
        """Free the model, KV cache and swap space now; dropping the last reference does the same."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json defaults (temperature, top_p, top_k, ...)."""
        return self.engine.default_sampling_params()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def _normalise(self, prompts) -> list[PromptType]:
        if isinstance(prompts, str | dict):
            return [prompts]
        if isinstance(prompts, Seq) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        return list(prompts)

    def _to_ids(self, index: int, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.encode(prompt) if prompt else []
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._to_ids(index, prompt["prompt"])
            raise RequestError(f"request {index}: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, Seq) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise RequestError(f"request {index}: prompt must be text, token ids or a dict, got {type(prompt).__name__}")

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. lora_request: the LoRA
        adapter to run with (engine built with enable_lora=True), one for all or one per prompt
        (None: the base model); requests with different adapters share batches.

        Every prompt and parameter set is validated before any work starts; an invalid one
        raises ValueError (RequestError) naming its index and field.
        """
        items = self._normalise(prompts)
        if sampling_params is None:
            sampling_params = self.engine.default_sampling_params()  # generation_config.json
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise RequestError(
                    f"sampling_params: got {len(params)} for {len(items)} prompts; give one or one per prompt"
                )
        if isinstance(lora_request, list | tuple):
            adapters = list(lora_request)
            if len(adapters) != len(items):
                raise RequestError(f"lora_request: got {len(adapters)} for {len(items)} prompts; give one or one "
                                   "per prompt")
        else:
            adapters = [lora_request] * len(items)
        batch = []
        for i, (prompt, p, lora) in enumerate(zip(items, params, adapters)):
            if isinstance(p, SamplingParams):  # only final outputs are read (as vLLM's LLM asks)
                p = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
            text, ids = self._to_ids(i, prompt)
            self.engine.validate(i, ids, p, lora)
            batch.append((text, ids, p, lora))
        ids_in_order = []
        for text, ids, p, lora in batch:
            rid = str(self._counter)
            self._counter += 1
            self.engine.add_request(rid, text, ids, p, lora)
            ids_in_order.append(rid)
        return self._run(ids_in_order, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generate", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in request_ids:  # leave the engine clean (no leaked blocks) on Ctrl-C / errors
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return [done[r] for r in request_ids]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template, then generate."""
        tok = self.engine.tokenizer
        if tok is None:
            raise RequestError(f"{self.engine.model_path} has no tokenizer, so chat() cannot render messages")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for i, conv in enumerate(conversations):
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
            ids = tok.encode(text, add_special_tokens=False)
            if not ids:
                raise RequestError(f"request {i}: the rendered conversation is empty")
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)
