"""One log line format for every Strata process: timestamp, level, logger, message.

The CLI, the server's front end, its engine and tokenizer processes and tensor-parallel ranks all
call `setup_logging`, so a server's interleaved stderr reads as one log (`--log-level`, `-v`).
"""

from __future__ import annotations

import logging
import re
import sys

LEVELS = ("debug", "info", "warning", "error", "critical")
FORMAT = "%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def level_number(level: str | int) -> int:
    """'info' / 'INFO' / 20 -> 20; anything else is a ValueError naming the choices."""
    if isinstance(level, int):
        return level
    number = logging.getLevelName(str(level).upper())
    if not isinstance(number, int):
        raise ValueError(f"log level {level!r}: choose one of {', '.join(LEVELS)}")
    return number


def setup_logging(level: str | int = "warning") -> None:
    """Root handler on stderr with FORMAT (replacing any earlier one: a second call changes the level)."""
    logging.basicConfig(level=level_number(level), format=FORMAT, datefmt=DATE_FORMAT, stream=sys.stderr,
                        force=True)
    logging.captureWarnings(True)  # warnings.warn lines get a timestamp and level too

# what every line starts with (tests and log readers match it): "2026-12-01 10:00:00.123 INFO    name: "
LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) +[\w.]+: ")
