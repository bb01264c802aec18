"""OpenAI response bodies and stream chunks, built from the front end's choice deltas."""

from __future__ import annotations

import time
from typing import Any

from strata.protocol.tokenizer import IncrementalDetokenizer
from strata.server.generation import ChoiceDelta


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def token_pieces(ids: list[int], detok: IncrementalDetokenizer, final: bool) -> list[str]:
    """What each id adds to the text `detok` makes (the returned text is made the same way), so the
    pieces join to exactly that text: a skipped special token (an added BOS, an EOS) adds "", a
    character split over tokens lands on the token that completes it; `final` releases the rest
    (an unfinished character) onto the last piece."""
    pieces = [detok.add(t) for t in ids]
    if final and pieces:
        pieces[-1] += detok.flush()
    return pieces


def prompt_text(tokenizer, ids: list[int], skip_special_tokens: bool) -> str:
    """The echoed prompt: its ids' text as the completion's text is made (an added BOS shows only
    with skip_special_tokens false), so the prompt's logprob tokens join to it."""
    return "".join(token_pieces(ids, IncrementalDetokenizer(tokenizer, [], skip_special_tokens), final=True))


class CompletionLogprobs:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset, for one
    choice. `tokens` are the pieces of the returned text (token_pieces: one entry per token, ""
    for a skipped special token, as vLLM), so "".join(tokens) is the text and text_offset[i] indexes
    into it; top_logprobs keys stay each alternative's own token text."""

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.offset = 0
        self._out = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)

    def prompt(self, ids: list[int], logprobs: list[dict[int, float] | None], num_top: int) -> dict[str, list]:
        """The echoed prompt's entries (they come first); they join to prompt_text(ids)."""
        pieces = token_pieces(ids, IncrementalDetokenizer(self.tok, [], self.skip), final=True)
        return self._entries(ids, pieces, logprobs, num_top)

    def add(self, token_ids: list[int], logprobs: list[dict[int, float]], num_top: int,
            final: bool = False) -> dict[str, list]:
        """The completion's next entries; `final`: the choice ends with them."""
        return self._entries(token_ids, token_pieces(token_ids, self._out, final), logprobs, num_top)

    def _entries(self, ids, pieces, logprobs, num_top) -> dict[str, list]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, text, d in zip(ids, pieces, logprobs):  # d None: the prompt's first token (nothing before it)
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


__all__ = ["ChoiceDelta", "CompletionLogprobs", "prompt_text", "token_pieces", "chat_logprobs", "completion_chunk",
           "chat_chunk", "usage", "now"]
