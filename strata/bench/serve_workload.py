"""`strata bench serve`'s configuration and its seeded workload: what is sent, and when.

ServeBenchConfig (one load test), the parsing of its flags (--request-rate, --slo, --url, the API
key), and plan_requests(): per request the prompt text (random token ids decoded with the
tokenizer, avoiding special tokens), its planned lengths, and its arrival time (Poisson, or gamma
gaps with shape --burstiness; all at 0 for rate inf), all fixed by --seed before anything is sent.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

import strata.demo
from strata.bench.common import random_prompts
from strata.errors import ConfigError
from strata.protocol.tokenizer import Tokenizer

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
API_KEY_ENV = ("STRATA_API_KEY", "OPENAI_API_KEY")
SLO_KEYS = ("ttft", "tpot")


# ----------------------------------------------------------------------------------------------
# configuration


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
    return Path(strata.demo.__file__).parent


def load_tokenizer(path: str | None):
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
