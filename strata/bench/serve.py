"""Online serving: a load generator for any OpenAI-compatible server (Strata, vLLM, llama-server).

Sends --num-prompts streaming requests to --url, arriving as a Poisson process at --request-rate
req/s (or gamma-distributed gaps with shape --burstiness and the same mean, as vLLM's
benchmark_serving does; burstiness < 1 is burstier, > 1 more regular; `inf` sends every request
at once), with at most --max-concurrency in flight. Each prompt is --input-len random token ids
(N or LO:HI uniform) decoded to text with --tokenizer (default: the demo model's tokenizer; give
the served model's tokenizer directory for exact prompt lengths), avoiding special tokens. Each
request asks for --output-len tokens (N or LO:HI uniform) with temperature 0, "ignore_eos": true
and "stream_options": {"include_usage": true}. Everything is seeded by --seed.

Per request: TTFT (send -> first chunk with text), the gaps between successive text chunks (ITL),
end-to-end latency, and TPOT = (e2e - TTFT) / (output tokens - 1). Output and prompt tokens come
from the server's usage chunk when it sends one (else: text chunks counted, planned prompt
length). A non-200 status, an error chunk or an exception marks the request failed; the run goes
on and the first distinct errors are printed. Goodput counts the requests per second meeting every
--slo bound. Connections go straight to --url (proxy variables are ignored).

examples:
  strata serve &                                            # then, in another shell:
  strata bench serve --url http://127.0.0.1:8000 --num-prompts 200 --request-rate 4
  strata bench serve --url http://127.0.0.1:8000/v1 --request-rate inf --max-concurrency 8 \\
      --input-len 128:512 --output-len 64:256 --slo ttft=500,tpot=50 --json serve.json
  strata bench serve --url http://127.0.0.1:8080 --endpoint chat --tokenizer ./Qwen2.5-0.5B
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from strata.bench.common import parse_range, random_prompts, write_json
from strata.errors import ConfigError, StrataError
from strata.text_table import print_table

NAME = "serve"
HELP = "load-test any OpenAI-compatible server: TTFT, TPOT, ITL, throughput, goodput"

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
API_KEY_ENV = ("STRATA_API_KEY", "OPENAI_API_KEY")
SLO_KEYS = ("ttft", "tpot")
STATS = ("mean", "p50", "p90", "p99")
MAX_ERRORS_SHOWN = 5


# ----------------------------------------------------------------------------------------------
# configuration and results


@dataclass
class ServeBenchConfig:
    """One load test. Lengths are inclusive (lo, hi) token ranges; SLOs are in milliseconds."""

    url: str
    model: str | None = None  # None: the first id from GET /v1/models
    num_prompts: int = 100
    request_rate: float = math.inf  # req/s; inf sends every request at once
    burstiness: float = 1.0  # gamma shape of the inter-arrival gaps; 1.0 = Poisson
    max_concurrency: int | None = None  # cap on requests in flight; None = no cap
    input_len: tuple[int, int] = (128, 128)
    output_len: tuple[int, int] = (128, 128)
    endpoint: str = "completions"  # or "chat"
    api_key: str | None = None  # None: $STRATA_API_KEY, then $OPENAI_API_KEY
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    tokenizer: str | None = None  # HF directory with tokenizer.json; None: the demo tokenizer
    seed: int = 0
    timeout_s: float = 3600.0  # per request
    extra_body: dict[str, Any] | None = None  # merged into every request body
    progress: bool = True  # tqdm bar on stderr

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field."""
        if self.num_prompts < 1:
            raise ConfigError(f"--num-prompts: must be >= 1, got {self.num_prompts}")
        if not (self.request_rate > 0):  # also rejects NaN
            raise ConfigError(f"--request-rate: must be > 0 or inf, got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ConfigError(f"--burstiness: must be a finite number > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError(f"--max-concurrency: must be >= 1, got {self.max_concurrency}")
        for flag, (lo, hi) in (("--input-len", self.input_len), ("--output-len", self.output_len)):
            if lo < 1 or hi < lo:
                raise ConfigError(f"{flag}: expected 1 <= LO <= HI, got {lo}:{hi}")
        if self.endpoint not in ENDPOINTS:
            raise ConfigError(f"--endpoint: expected one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        for key, v in (("ttft", self.slo_ttft_ms), ("tpot", self.slo_tpot_ms)):
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"--slo: {key} must be a finite number of ms > 0, got {v}")
        if not (self.timeout_s > 0):
            raise ConfigError(f"--timeout: must be > 0 seconds, got {self.timeout_s}")

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON-ready data, without the API key itself."""
        d = asdict(self)
        d["api_key"] = None
        d["api_key_set"] = resolve_api_key(self.api_key) is not None
        d["input_len"], d["output_len"] = list(self.input_len), list(self.output_len)
        return d


@dataclass
class PlannedRequest:
    """One request of the workload, fixed by the seed before anything is sent."""

    index: int
    prompt: str
    prompt_len: int  # planned prompt tokens (random ids drawn before decoding to text)
    output_len: int  # max_tokens
    arrival_s: float  # scheduled send time after the start of the run


@dataclass
class RequestRecord:
    """What happened to one request. Times are in seconds; start_s is relative to the run start."""

    index: int
    prompt_len: int  # planned
    output_len: int  # requested (max_tokens)
    arrival_s: float  # scheduled
    start_s: float = math.nan  # actually sent (after waiting for a --max-concurrency slot)
    success: bool = False
    error: str | None = None
    ttft_s: float = math.nan
    latency_s: float = math.nan  # end to end
    itl_s: list[float] = field(default_factory=list)  # gaps between successive text chunks
    output_tokens: int = 0  # usage.completion_tokens, else text chunks
    prompt_tokens: int = 0  # usage.prompt_tokens, else prompt_len
    text_chunks: int = 0
    usage_reported: bool = False

    @property
    def tpot_s(self) -> float:
        if not self.success or self.output_tokens < 2:
            return math.nan
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


@dataclass
class ServeBenchResult:
    """Figures of one run. Latency stats are dicts of mean/p50/p90/p99 in ms (NaN when empty)."""

    config: ServeBenchConfig
    url: str  # server root, without /v1
    model: str
    records: list[RequestRecord]
    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tok/s
    total_token_throughput: float  # (input + output) tok/s
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    good_requests: int | None  # None without an SLO
    goodput: float | None  # good requests / s
    max_concurrency_observed: int
    short_outputs: int  # completed requests with fewer output tokens than max_tokens
    errors: dict[str, int]  # distinct error message -> count, in order of first occurrence

    def to_dict(self, with_records: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {"benchmark": NAME, "config": self.config.to_dict()}
        d |= {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("config", "records")}
        d["slo"] = {"ttft_ms": self.config.slo_ttft_ms, "tpot_ms": self.config.slo_tpot_ms}
        if with_records:
            d["requests"] = [r.to_dict() for r in self.records]
        return d


# ----------------------------------------------------------------------------------------------
# parsing


def parse_rate(text: str | float, flag: str = "--request-rate") -> float:
    """'inf' -> math.inf; '2.5' -> 2.5; anything else, <= 0 or NaN is a ConfigError."""
    try:
        v = float(text)
    except (TypeError, ValueError):
        v = math.nan
    if not (v > 0):
        raise ConfigError(f"{flag}: expected requests per second > 0 or 'inf', got {text!r}")
    return v


def parse_slo(text: str | None) -> tuple[float | None, float | None]:
    """'ttft=200,tpot=50' -> (200.0, 50.0) in ms; either key may be left out; None -> (None, None)."""
    if text is None:
        return None, None
    found: dict[str, float] = {}
    for part in str(text).split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        try:
            v = float(value)
        except ValueError:
            v = math.nan
        if not sep or key not in SLO_KEYS or key in found or not (v > 0 and math.isfinite(v)):
            raise ConfigError(
                f"--slo: expected KEY=MS pairs separated by commas, keys {' and '.join(SLO_KEYS)} "
                f"(each at most once), values > 0, e.g. ttft=200,tpot=50; got {text!r}"
            )
        found[key] = v
    return found.get("ttft"), found.get("tpot")


def server_root(url: str) -> str:
    """'127.0.0.1:8000/v1/' -> 'http://127.0.0.1:8000' (the API paths are added to it)."""
    root = str(url).strip()
    if not root:
        raise ConfigError("--url: give the server's base URL, e.g. http://127.0.0.1:8000")
    if "://" not in root:
        root = "http://" + root
    root = root.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root


def resolve_api_key(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    for name in API_KEY_ENV:
        if os.environ.get(name):
            return os.environ[name]
    return None


# ----------------------------------------------------------------------------------------------
# workload


def _demo_tokenizer_dir() -> Path:
    """strata/demo ships the demo model's tokenizer.json and tokenizer_config.json."""
    import strata.demo

    return Path(strata.demo.__file__).parent


def load_tokenizer(path: str | None):
    from strata.engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(path if path is not None else _demo_tokenizer_dir())


def _avoided_ids(tok) -> set[int]:
    """Special tokens, plus tokens that decode to nothing, a partial character or a control character."""
    avoid = {int(i) for i in tok.all_special_ids}
    for i in range(tok.vocab_size):
        if i not in avoid:
            text = tok.decode([i], skip_special_tokens=True)
            if not text or "\ufffd" in text or not all(c.isprintable() or c.isspace() for c in text):
                avoid.add(i)
    return avoid


def plan_requests(cfg: ServeBenchConfig, tokenizer=None) -> list[PlannedRequest]:
    """The seeded workload: prompt text and lengths per request, and its scheduled send time.

    Lengths and prompts come from one generator, arrival gaps from another, so changing the rate
    keeps the same prompts. The first request is sent at 0, as in vLLM's benchmark_serving.
    """
    cfg.validate()
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer)
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_prompts
    in_lens = rng.integers(cfg.input_len[0], cfg.input_len[1] + 1, size=n).tolist()
    out_lens = rng.integers(cfg.output_len[0], cfg.output_len[1] + 1, size=n).tolist()
    ids = random_prompts(rng, tok.vocab_size, in_lens, _avoided_ids(tok))
    prompts = []
    for want, p in zip(in_lens, ids):
        # text -> ids can merge across the random boundaries: re-encode and cut to the planned length
        again = tok.encode(tok.decode(p, skip_special_tokens=True), add_special_tokens=False)[:want]
        prompts.append(tok.decode(again, skip_special_tokens=True))
    arrivals = np.zeros(n)
    if math.isfinite(cfg.request_rate) and n > 1:
        arng = np.random.default_rng([cfg.seed, 1])
        theta = 1.0 / (cfg.request_rate * cfg.burstiness)  # mean gap = shape * scale = 1 / rate
        arrivals[1:] = np.cumsum(arng.gamma(shape=cfg.burstiness, scale=theta, size=n - 1))
    return [PlannedRequest(i, prompts[i], in_lens[i], out_lens[i], float(arrivals[i])) for i in range(n)]


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


def _stats_ms(values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {k: math.nan for k in STATS}
    a = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _meets_slo(rec: RequestRecord, cfg: ServeBenchConfig) -> bool:
    if cfg.slo_ttft_ms is not None and not rec.ttft_s * 1e3 <= cfg.slo_ttft_ms:
        return False
    tpot = rec.tpot_s  # NaN for a single output token: no decode step to hold to the bound
    return cfg.slo_tpot_ms is None or math.isnan(tpot) or tpot * 1e3 <= cfg.slo_tpot_ms


def summarize(cfg: ServeBenchConfig, root: str, model: str, records: list[RequestRecord],
              duration_s: float, max_in_flight: int) -> ServeBenchResult:
    ok = [r for r in records if r.success]
    inp = sum(r.prompt_tokens for r in ok)
    out = sum(r.output_tokens for r in ok)
    dur = duration_s if duration_s > 0 else math.nan
    good: int | None = None
    if cfg.slo_ttft_ms is not None or cfg.slo_tpot_ms is not None:
        good = sum(_meets_slo(r, cfg) for r in ok)
    errors = Counter(r.error for r in records if not r.success and r.error is not None)
    return ServeBenchResult(
        config=cfg, url=root, model=model, records=records, duration_s=duration_s,
        completed=len(ok), failed=len(records) - len(ok), total_input_tokens=inp, total_output_tokens=out,
        request_throughput=len(ok) / dur, output_throughput=out / dur, total_token_throughput=(inp + out) / dur,
        ttft_ms=_stats_ms([r.ttft_s for r in ok]),
        tpot_ms=_stats_ms([r.tpot_s for r in ok if r.output_tokens > 1]),
        itl_ms=_stats_ms([x for r in ok for x in r.itl_s]),
        e2e_ms=_stats_ms([r.latency_s for r in ok]),
        good_requests=good, goodput=None if good is None else good / dur,
        max_concurrency_observed=max_in_flight,
        short_outputs=sum(r.output_tokens < r.output_len for r in ok),
        errors=dict(errors),
    )


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


# ----------------------------------------------------------------------------------------------
# report and CLI


def _slo_text(cfg: ServeBenchConfig) -> str:
    parts = [f"{k} <= {v:g} ms" for k, v in (("TTFT", cfg.slo_ttft_ms), ("TPOT", cfg.slo_tpot_ms))
             if v is not None]
    return ", ".join(parts)


def _range_text(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}:{r[1]}"


def print_result(res: ServeBenchResult, file=None) -> None:
    """The two tables (summary; latency percentiles) plus the first distinct errors."""
    file = file or sys.stdout
    cfg = res.config
    rows: list[list[Any]] = [
        ["completed requests", res.completed],
        ["failed requests", res.failed],
        ["duration s", res.duration_s],
        ["request throughput req/s", res.request_throughput],
        ["output token throughput tok/s", res.output_throughput],
        ["total token throughput tok/s", res.total_token_throughput],
        ["input tokens", res.total_input_tokens],
        ["output tokens", res.total_output_tokens],
        ["max concurrent requests", res.max_concurrency_observed],
    ]
    if res.goodput is not None:
        rows.append([f"goodput req/s ({_slo_text(cfg)})", res.goodput])
        rows.append(["requests within SLO", f"{res.good_requests}/{res.completed}"])
    print_table(["metric", "value"], rows, file=file)
    print(file=file)
    lat = [[name] + [d[k] for k in STATS] for name, d in
           (("TTFT", res.ttft_ms), ("TPOT", res.tpot_ms), ("ITL", res.itl_ms), ("e2e", res.e2e_ms))]
    print_table(["latency ms"] + list(STATS), lat, file=file)
    if res.short_outputs:
        print(f"note: {res.short_outputs} completed requests returned fewer tokens than max_tokens "
              "(does the server honour ignore_eos?)", file=file)
    if res.errors:
        print(f"\n{res.failed} requests failed; first distinct errors:", file=file)
        for msg, count in list(res.errors.items())[:MAX_ERRORS_SHOWN]:
            print(f"  [{count}x] {msg}", file=file)
        if len(res.errors) > MAX_ERRORS_SHOWN:
            print(f"  ... and {len(res.errors) - MAX_ERRORS_SHOWN} more (all in --json)", file=file)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    g.add_argument("--model", default=None, help="model name to send (default: the first id from GET /v1/models)")
    g.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions",
                   help="/v1/completions (default) or /v1/chat/completions")
    g.add_argument("--api-key", default=None,
                   help=f"sent as 'Authorization: Bearer KEY' (default: ${' or $'.join(API_KEY_ENV)})")
    g.add_argument("--timeout", type=float, default=3600.0, help="seconds one request may take (default 3600)")
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    g.add_argument("--request-rate", default="inf", help="mean arrivals per second, or inf: all at once (default)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson (default), < 1 burstier, > 1 steadier")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    g.add_argument("--input-len", default="128", help="prompt tokens, N or LO:HI uniform (default 128)")
    g.add_argument("--output-len", default="128", help="max_tokens, N or LO:HI uniform (default 128)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="HF directory with tokenizer.json to build prompts (default: the demo tokenizer)")
    g.add_argument("--seed", type=int, default=0, help="seed for lengths, token ids and arrival times")
    g = p.add_argument_group("report")
    g.add_argument("--slo", default=None, metavar="ttft=MS,tpot=MS",
                   help="goodput counts requests within these bounds (either key may be left out)")
    g.add_argument("--json", default=None, metavar="FILE", help="write figures, config and every request to FILE")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    slo_ttft, slo_tpot = parse_slo(args.slo)
    cfg = ServeBenchConfig(
        url=server_root(args.url), model=args.model, num_prompts=args.num_prompts,
        request_rate=parse_rate(args.request_rate), burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        input_len=parse_range(args.input_len, "--input-len"),
        output_len=parse_range(args.output_len, "--output-len"),
        endpoint=args.endpoint, api_key=args.api_key, slo_ttft_ms=slo_ttft, slo_tpot_ms=slo_tpot,
        tokenizer=args.tokenizer, seed=args.seed, timeout_s=args.timeout, progress=not args.no_progress,
    )
    cfg.validate()
    return cfg


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}"
    cap = cfg.max_concurrency if cfg.max_concurrency is not None else "no cap"
    print(f"server {cfg.url}, {ENDPOINTS[cfg.endpoint]}\n"
          f"{cfg.num_prompts} requests at {rate} req/s (burstiness {cfg.burstiness:g}), max concurrency {cap}, "
          f"input {_range_text(cfg.input_len)} / output {_range_text(cfg.output_len)} tokens, seed {cfg.seed}")
    res = asyncio.run(run_benchmark(cfg))
    print(f"model {res.model}\n")
    print_result(res)
    write_json(args.json, res.to_dict())
    return 0
