"""What the HTTP layer shares: the server's options and live state.

A module of its own so the app factory and the route modules can all take it explicitly (routes
read it from `request.app.state.strata`) without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from strata.config import parse_bytes
from strata.errors import ConfigError
from strata.server.lora import LoRARegistry
from strata.server.metrics import Metrics


@dataclass
class ServerOptions:
    """The server's own flags, validated once here (messages name the flag and the fix)."""

    served_model_name: str  # the id responses carry (the first --served-model-name)
    api_key: str | None = None
    aliases: tuple[str, ...] = ()  # further --served-model-name ids requests may use
    log_requests: bool = True  # an access log line per request (--disable-log-requests turns it off)
    max_request_bytes: int | str = 1 << 20  # bytes or "1MiB"
    max_queue: int = 256
    drain_timeout: float = 30.0
    tokenizer_workers: int | None = None  # None: from spare cores
    startup_timeout: float = 600.0

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every id this server answers to, the primary first (/v1/models lists them all)."""
        return tuple(dict.fromkeys((self.served_model_name, *self.aliases)))

    def __post_init__(self) -> None:
        self.max_request_bytes = parse_bytes(self.max_request_bytes, "--max-request-bytes")
        if self.tokenizer_workers is not None and self.tokenizer_workers < 0:
            raise ConfigError(f"--tokenizer-workers must be >= 0, got {self.tokenizer_workers}")
        if self.max_queue < 1:
            raise ConfigError(f"--max-queue must be >= 1, got {self.max_queue}")
        if self.drain_timeout < 0:
            raise ConfigError(f"--drain-timeout must be >= 0 seconds, got {self.drain_timeout}")
        if self.startup_timeout <= 0:
            raise ConfigError(f"--startup-timeout must be > 0 seconds, got {self.startup_timeout}")


@dataclass
class ServerState:
    options: ServerOptions
    metrics: Metrics
    engine: object = None  # EngineClient once started
    tokenizers: object = None  # TokenizerPool or InLoopTokenizer
    tokenizer: object = None  # the front end's own copy, for detokenisation
    info: dict = field(default_factory=dict)
    ready: bool = False  # start-up finished (the model loaded once); `outage` says if it is down now
    draining: bool = False
    failed: str | None = None  # the server gave up (a child cannot be restarted): /health is 503
    waiting: int = 0  # admitted requests without a first token yet (what --max-queue bounds)
    in_flight: set = field(default_factory=set)  # asyncio tasks serving generation requests
    loras: LoRARegistry = field(default_factory=LoRARegistry)  # the adapters `model` may name

    @property
    def outage(self) -> str | None:
        """Why the server cannot serve right now although it has started (a child is down), or None."""
        if self.failed:
            return f"the server is shutting down: {self.failed}"
        for part in (self.engine, self.tokenizers):
            why = getattr(part, "outage", None)
            if why:
                return why
        return None


def server_state(request: Request) -> ServerState:
    """The state build_app attached to the app serving this request."""
    return request.app.state.strata
