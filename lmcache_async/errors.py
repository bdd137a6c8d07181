"""Exceptions raised by lmcache_async.

Every exception derives from :class:`LMCacheAsyncError`; the subclasses are split by what
the caller can do next::

    LMCacheAsyncError
    ├── InvalidInputError (ValueError)        bad arguments: fix the call
    │   └── ConfigError                       a configuration field is invalid (.field)
    ├── AllocationTimeoutError (TimeoutError) no host memory in time: retry or store less
    ├── TierError                             a storage tier failed
    │   └── TierUnavailableError              the tier is down or unreachable
    ├── IntegrityError                        stored bytes failed their checksum
    ├── ProtocolError                         a malformed or unexpected wire message
    └── EngineClosedError (RuntimeError)      the engine was closed
"""

from __future__ import annotations

__all__ = [
    "AllocationTimeoutError",
    "ConfigError",
    "EngineClosedError",
    "IntegrityError",
    "InvalidInputError",
    "LMCacheAsyncError",
    "ProtocolError",
    "TierError",
    "TierUnavailableError",
]


class LMCacheAsyncError(Exception):
    """Root of every exception this package raises on purpose."""


class InvalidInputError(LMCacheAsyncError, ValueError):
    """An argument is malformed: wrong shape, dtype, length, range or combination."""


class ConfigError(InvalidInputError):
    """A configuration value is invalid; :attr:`field` names the offending key."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class AllocationTimeoutError(LMCacheAsyncError, TimeoutError):
    """Host memory could not be allocated before the timeout."""


class TierError(LMCacheAsyncError):
    """A storage tier failed to complete an operation."""


class TierUnavailableError(TierError):
    """A storage tier is down or unreachable."""


class IntegrityError(LMCacheAsyncError):
    """Stored bytes do not match their checksum or header."""


class ProtocolError(LMCacheAsyncError):
    """A wire message is malformed, oversized, of unknown type or wrong version."""


class EngineClosedError(LMCacheAsyncError, RuntimeError):
    """The engine (or a component of it) is closed and refuses new work."""
