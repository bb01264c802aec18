"""OpenAI response bodies and stream chunks, built from the front end's choice deltas."""

from __future__ import annotations

import time
from typing import Any

from strata.server.generation import ChoiceDelta


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


class CompletionLogprobs:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, tokenizer, start_offset: int = 0) -> None:
        self.tok = tokenizer
        self.offset = start_offset

    def add(self, token_ids: list[int], logprobs: list[dict[int, float]], num_top: int) -> dict[str, list]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, d in zip(token_ids, logprobs):  # d None: the prompt's first token (nothing before it)
            text = _token_text(self.tok, tok)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if d is None else d.get(tok))
            top = sorted(d.items(), key=lambda kv: -kv[1])[:num_top] if num_top and d is not None else []
            out["top_logprobs"].append({_token_text(self.tok, t): v for t, v in top} if num_top and d is not None
                                       else None)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    @staticmethod
    def merge(parts: list[dict[str, list]]) -> dict[str, list]:
        merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for p in parts:
            for k in merged:
                merged[k] += p[k]
        return merged


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], num_top: int) -> list[dict]:
    """The chat format: one entry per token with its bytes and the top alternatives."""
    content = []
    for tok, d in zip(token_ids, logprobs):
        text = _token_text(tokenizer, tok)
        top = sorted(d.items(), key=lambda kv: -kv[1])[:num_top]
        content.append({
            "token": text, "logprob": d.get(tok), "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := _token_text(tokenizer, i)), "logprob": v, "bytes": list(t.encode())}
                             for i, v in top],
        })
    return content


def completion_chunk(rid: str, model: str, created: int, choices: list[dict], usage_: dict | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def chat_chunk(rid: str, model: str, created: int, choices: list[dict], usage_: dict | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def now() -> int:
    return int(time.time())


__all__ = ["ChoiceDelta", "CompletionLogprobs", "chat_logprobs", "completion_chunk", "chat_chunk", "usage", "now"]
