"""Strata's error hierarchy: every user-facing failure names the problem and the fix."""


class StrataError(Exception):
    """Base class for errors caused by input or environment, not by a Strata bug."""


class ConfigError(StrataError, ValueError):
    """An invalid configuration value (names the field and the fix)."""


class ModelLoadError(StrataError):
    """A checkpoint that cannot be loaded (names the file or tensor)."""


class RequestError(StrataError, ValueError):
    """An invalid request (names the request index and field)."""


class CapacityError(StrataError):
    """The request or configuration cannot fit in the available memory."""
