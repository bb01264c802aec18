"""Strata's error hierarchy: every user-facing failure names the problem and the fix."""


class StrataError(Exception):
    """Base class for errors caused by input or environment, not by a Strata bug."""


class ConfigError(StrataError, ValueError):
    """An invalid configuration value (names the field and the fix)."""


class ModelLoadError(StrataError):
    """A checkpoint that cannot be loaded (names the file or tensor)."""


class RequestError(StrataError, ValueError):
    """An invalid request (names the request index and field; `param` is the field, when known)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class CapacityError(StrataError):
    """The request or configuration cannot fit in the available memory."""
