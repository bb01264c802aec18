"""Test hooks, off unless STRATA_TEST_FAULTS is set: `tokenize_delay=0.05,raise_on=TEXT`.

They plant failures and slowdowns for the server's robustness tests and the analyzer's planted
bottlenecks; parsing costs nothing when the variable is absent. The keys:

  tokenize_delay=S         every tokenisation sleeps S seconds first (worker or in-loop)
  raise_on=TEXT            a prompt containing TEXT raises in the front end (a 500)
  tokenizer_exit_on=TEXT   a tokenizer worker given TEXT exits at once (a worker crash)
  engine_exit_from=N       the engine process's start number N and later (0 = the first, 1 = the
                           first restart, ...) exit before loading the model (a crash loop)
  engine_start_delay=S     the engine process sleeps S seconds before loading (a slow load)
  skip_port_check=1        do not pre-bind the HTTP port: uvicorn binds it late (the race path)
  lora_load_gate=PATH      while PATH exists, the engine process holds LoRA adapter loads before
                           reading them (steps go on: a slow load that must not stall requests)
  engine_step_gate=PATH    while PATH exists, the engine process takes no step (requests wait in
                           its queue, stats still go out: a busy engine, held deterministically)
"""

from __future__ import annotations

import os
from functools import cache

from strata.settings import SETTINGS


@cache
def faults() -> dict[str, str]:
    spec = SETTINGS.test_faults
    return dict(item.split("=", 1) for item in spec.split(",") if "=" in item)


def tokenize_delay() -> float:
    return float(faults().get("tokenize_delay", 0.0))


def should_raise(text: str) -> bool:
    marker = faults().get("raise_on")
    return bool(marker) and marker in text


def tokenizer_should_exit(job: dict) -> bool:
    marker = faults().get("tokenizer_exit_on")
    return bool(marker) and marker in str(job.get("text", "")) + str(job.get("messages", ""))


def engine_should_exit(start_number: int) -> bool:
    first = faults().get("engine_exit_from")
    return first is not None and start_number >= int(first)


def engine_start_delay() -> float:
    return float(faults().get("engine_start_delay", 0.0))


def skip_port_check() -> bool:
    return faults().get("skip_port_check") == "1"


def _gate_closed(key: str) -> bool:
    path = faults().get(key)
    return bool(path) and os.path.exists(path)


def lora_load_held() -> bool:
    return _gate_closed("lora_load_gate")


def engine_step_held() -> bool:
    return _gate_closed("engine_step_gate")
