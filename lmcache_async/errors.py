"""Exceptions raised by lmcache_async.

Every exception derives from :class:`LMCacheAsyncError`; the subclasses are split by what
the caller can do next::

    LMCacheAsyncError
    ├── InvalidInputError (ValueError)        bad arguments: fix the call
    │   └── ConfigError                       a configuration field is invalid (.field)
    ├── AllocationTimeoutError (TimeoutError) no host memory in time: retry or store less
    ├── TierError                             a storage tier failed
    │   ├── TierUnavailableError              the tier is down or unreachable
    │   └── EraseIncompleteError              erasure failed in some tiers: retry (.failed)
    ├── IntegrityError                        stored bytes failed their checksum
    ├── ProtocolError                         a malformed or unexpected wire message
    ├── PermissionDeniedError (PermissionError) the peer's certificate does not allow it
    └── EngineClosedError (RuntimeError)      the engine was closed
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "AllocationTimeoutError",
    "ConfigError",
    "EngineClosedError",
    "EraseIncompleteError",
    "IntegrityError",
    "InvalidInputError",
    "LMCacheAsyncError",
    "PermissionDeniedError",
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


class EraseIncompleteError(TierError):
    """Erasing a tenant failed in some tiers (down, failing, or unable to erase): the
    tenant's chunks may remain there. :attr:`removed` has the chunks removed per tier that
    was erased, :attr:`failed` why each other tier was not; erasing again is safe."""

    def __init__(self, removed: Mapping[str, int], failed: Mapping[str, str]) -> None:
        self.removed = dict(removed)
        self.failed = dict(failed)
        why = "; ".join(f"{tier}: {reason}" for tier, reason in self.failed.items())
        done = ", ".join(f"{tier} {count}" for tier, count in self.removed.items()) or "none"
        super().__init__(f"erasure failed in {why} (chunks removed: {done})")

    def __reduce__(
        self,
    ) -> tuple[type[EraseIncompleteError], tuple[dict[str, int], dict[str, str]]]:
        return type(self), (self.removed, self.failed)


class IntegrityError(LMCacheAsyncError):
    """Stored bytes do not match their checksum or header."""


class ForeignRecordError(IntegrityError):
    """A record sealed under another key, or stored in the clear where this tier encrypts
    (or the reverse): unreadable here, but not corrupt, so it is a miss and is left in
    place for the engines that can read it (a shared Redis, a disk directory reused)."""


class ProtocolError(LMCacheAsyncError):
    """A wire message is malformed, oversized, of unknown type or wrong version."""


class PermissionDeniedError(LMCacheAsyncError, PermissionError):
    """The sidecar refused a request its peer's certificate does not allow (an erase,
    clear, move or shutdown from a client certificate): use an admin certificate."""


class EngineClosedError(LMCacheAsyncError, RuntimeError):
    """The engine (or a component of it) is closed and refuses new work."""
