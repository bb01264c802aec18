"""`strata bench serve`'s client: the async loop that sends the planned requests and streams them.

Requests go out at their planned arrival times, at most --max-concurrency in flight, over one
httpx client with direct connections (proxy variables are ignored). Each streamed response is
read chunk by chunk into its RequestRecord; a failure of one request is recorded, never raised.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import httpx

from strata.bench.serve_metrics import RequestRecord, ServeBenchResult, summarize
from strata.bench.serve_workload import (
    API_KEY_ENV,
    ENDPOINTS,
    PlannedRequest,
    ServeBenchConfig,
    plan_requests,
    resolve_api_key,
    server_root,
)
from strata.errors import ConfigError, StrataError

# ----------------------------------------------------------------------------------------------
# HTTP


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _exc_text(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


async def _resolve_model(client: httpx.AsyncClient, root: str, model: str | None, api_key: str | None) -> str:
    """Check that the server answers (GET /v1/models) and pick its first model when none is given."""
    try:
        resp = await client.get(f"{root}/v1/models", headers=_headers(api_key))
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as e:
        raise ConfigError(f"--url {root}: not a usable http(s) URL ({_exc_text(e)})") from None
    except httpx.TransportError as e:
        raise StrataError(
            f"cannot reach an OpenAI-compatible server at {root} ({_exc_text(e)}); start one with "
            f"`strata serve` (or vLLM / llama-server), or pass its address with --url"
        ) from None
    if resp.status_code in (401, 403):
        what = "rejected the API key" if api_key else "wants an API key"
        raise StrataError(
            f"{root}/v1/models answered {resp.status_code}: the server {what}; pass the right one with "
            f"--api-key KEY or set {' or '.join(API_KEY_ENV)}"
        )
    if model is not None:
        return model
    if resp.status_code != 200:
        raise StrataError(
            f"{root}/v1/models answered {resp.status_code} ({resp.text[:200]!r}); pass --model NAME"
        )
    try:
        models = resp.json().get("data") or []
        return str(models[0]["id"])
    except (ValueError, AttributeError, LookupError, TypeError):
        raise StrataError(
            f"{root}/v1/models listed no model ({resp.text[:200]!r}); pass --model NAME"
        ) from None


def _chunk_error(chunk: Any) -> str | None:
    if not isinstance(chunk, dict):
        return f"unexpected chunk {chunk!r:.200}"
    err = chunk.get("error")
    if err is not None:
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    if chunk.get("object") == "error":
        return str(chunk.get("message") or chunk)
    return None


def _chunk_text(chunk: dict) -> str:
    """Text of a completions or chat chunk (reasoning text counts: it is generated tokens too)."""
    parts = []
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if isinstance(choice.get("text"), str):
            parts.append(choice["text"])
        delta = choice.get("delta")
        if isinstance(delta, dict):
            for key in ("content", "reasoning_content", "reasoning"):
                if isinstance(delta.get(key), str):
                    parts.append(delta[key])
    return "".join(parts)


def _body(cfg: ServeBenchConfig, model: str, req: PlannedRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model}
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    body |= {
        "max_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    return body | (cfg.extra_body or {})


async def _send(client: httpx.AsyncClient, url: str, body: dict, headers: dict, rec: RequestRecord,
                t0: float) -> None:
    """Stream one request into `rec` (never raises, except on cancellation)."""
    usage: dict | None = None
    sent = time.perf_counter()
    rec.start_s = sent - t0
    last = sent
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace").strip()
                rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                return
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments, event: lines
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    rec.error = f"invalid JSON in stream: {data[:200]!r}"
                    return
                err = _chunk_error(chunk)
                if err is not None:
                    rec.error = f"error in stream: {err[:300]}"
                    return
                if _chunk_text(chunk):
                    now = time.perf_counter()
                    if rec.text_chunks == 0:
                        rec.ttft_s = now - sent
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                    rec.text_chunks += 1
                if isinstance(chunk.get("usage"), dict):
                    usage = chunk["usage"]
            rec.latency_s = time.perf_counter() - sent
    except Exception as e:  # any failure of one request is recorded, never raised (cancellation is)
        rec.error = _exc_text(e)
        return
    rec.usage_reported = usage is not None
    usage = usage or {}
    completion = usage.get("completion_tokens")
    rec.output_tokens = int(completion) if isinstance(completion, int) else rec.text_chunks
    prompt = usage.get("prompt_tokens")
    rec.prompt_tokens = int(prompt) if isinstance(prompt, int) else rec.prompt_len
    if rec.text_chunks == 0:
        rec.error = "the stream carried no generated text"
        return
    rec.success = True


# ----------------------------------------------------------------------------------------------
# the run


async def run_benchmark(cfg: ServeBenchConfig, tokenizer=None) -> ServeBenchResult:
    """Run the load test described by `cfg` against its server; failed requests are counted, not raised.

    Raises StrataError before sending anything when the config is invalid or the server cannot be
    reached. `tokenizer` (a strata Tokenizer) overrides cfg.tokenizer, to reuse one across runs.
    """
    from tqdm import tqdm

    cfg.validate()
    root = server_root(cfg.url)
    api_key = resolve_api_key(cfg.api_key)
    plan = plan_requests(cfg, tokenizer)
    conns = cfg.max_concurrency or cfg.num_prompts
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 30.0), pool=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        model = await _resolve_model(client, root, cfg.model, api_key)
        url, headers = root + ENDPOINTS[cfg.endpoint], _headers(api_key)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        in_flight = max_in_flight = 0
        bar = tqdm(total=len(plan), desc="requests", unit="req", file=sys.stderr, disable=not cfg.progress)
        records = [RequestRecord(p.index, p.prompt_len, p.output_len, p.arrival_s) for p in plan]

        async def one(req: PlannedRequest, rec: RequestRecord) -> None:
            nonlocal in_flight, max_in_flight
            if sem is not None:
                await sem.acquire()
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
            try:
                await _send(client, url, _body(cfg, model, req), headers, rec, t0)
            finally:
                in_flight -= 1
                if sem is not None:
                    sem.release()
                bar.update(1)

        tasks = []
        t0 = time.perf_counter()
        try:
            for req, rec in zip(plan, records):
                wait = t0 + req.arrival_s - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.create_task(one(req, rec)))
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            bar.close()
        duration = time.perf_counter() - t0
    return summarize(cfg, root, model, records, duration, max_in_flight)


def benchmark(cfg: ServeBenchConfig, tokenizer=None) -> ServeBenchResult:
    """run_benchmark() for callers without an event loop."""
    return asyncio.run(run_benchmark(cfg, tokenizer))
