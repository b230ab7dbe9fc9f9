"""Exception types. Every error a user can cause is one of these, with a clear message.

The CLI turns any ``KvstackError`` into one line on stderr and exit code 2; the server
into an OpenAI-style error object with status 400.
"""

from __future__ import annotations


class KvstackError(Exception):
    """Base class of every user-facing kvstack error."""


class ConfigError(KvstackError, ValueError):
    """An engine option is invalid (bad size, unknown dtype, ...)."""


class ModelLoadError(KvstackError):
    """A model file is missing, corrupt, truncated, or of an unsupported kind."""


class InvalidRequestError(KvstackError, ValueError):
    """A request's prompt or sampling parameters are invalid; nothing was scheduled.

    ``param`` names the offending request field when known (OpenAI's error ``param``).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
