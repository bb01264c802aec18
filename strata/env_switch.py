"""On-by-default features a STRATA_* environment variable turns off ("0", "false" or "off")."""

from __future__ import annotations

import os

OFF = ("0", "false", "off")


def switched_off(name: str) -> bool:
    """True when the environment variable `name` says off; unset or anything else: on."""
    return os.environ.get(name, "") in OFF
