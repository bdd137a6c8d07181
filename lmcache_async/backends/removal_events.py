"""Which chunks that leave a slow tier are recorded as removed KV events.

Each slow tier tells its removal listener the chunks it drops
(:meth:`~.base.StorageBackend.set_removal_listener`), through its writer (:mod:`.writers`,
which holds back those of a write under way until the write's stored event). Each report
is one removed event of that tier, except:

- during a clear of every tier (:meth:`RemovalEvents.clearing_all`): its one cleared event
  covers them;
- the chunks of the engine's tier probe (keys tagged :data:`PROBE_TAG`): never announced,
  stored or removed;
- chunks being written again (re-encoded, :meth:`RemovalEvents.rewriting`): they stay, so
  only those not written back are recorded, when the rewrite ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final

import blake3

from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.tenancy.tenants import TAG_BYTES

from .tier_events import TierEvents

__all__ = ["PROBE_TAG", "RemovalEvents"]

PROBE_TAG: Final = blake3.blake3(b"lmcache_async/probe/v1\x00").digest(length=TAG_BYTES)
"""The tag of the tier probe's keys (:mod:`lmcache_async.engine.probe`; tenant tags come
from another domain)."""


@dataclass(slots=True, eq=False)
class _Rewrite:
    tier: str
    keys: frozenset[bytes]
    held: list[ChunkKey] = field(default_factory=list)
    """Keys the tier reported removed meanwhile."""


class RemovalEvents:
    """Records in ``events`` the removals the slow tiers report (:meth:`record`), but
    those described in the module's docstring."""

    def __init__(self, events: TierEvents) -> None:
        self._events = events
        self._clearing_all = 0
        self._rewrites: list[_Rewrite] = []

    def record(self, tier: str, keys: Sequence[ChunkKey]) -> None:
        """Record that ``keys`` left the slow tier ``tier`` (its removal listener)."""
        if self._clearing_all:
            return
        keys = [key for key in keys if key[:TAG_BYTES] != PROBE_TAG]
        for rewrite in self._rewrites:
            if rewrite.tier == tier and keys:
                rewrite.held += [key for key in keys if key in rewrite.keys]
                keys = [key for key in keys if key not in rewrite.keys]
        self._events.removed(keys, tier)

    @contextlib.contextmanager
    def clearing_all(self) -> Iterator[None]:
        """Record nothing while every tier is cleared (the cleared event that follows
        covers it)."""
        self._clearing_all += 1
        try:
            yield
        finally:
            self._clearing_all -= 1

    @contextlib.contextmanager
    def rewriting(self, tier: str, keys: Sequence[ChunkKey]) -> Iterator[list[ChunkKey]]:
        """Hold back the removals of ``keys`` from the slow tier ``tier`` while they are
        written again; yields a list for the caller to extend with the keys it wrote
        back. On the way out, those the tier reported removed and that were not written
        back are recorded."""
        rewrite = _Rewrite(tier, frozenset(keys))
        self._rewrites.append(rewrite)
        back: list[ChunkKey] = []
        try:
            yield back
        finally:
            self._rewrites.remove(rewrite)
            kept = set(back)
            self.record(tier, [key for key in rewrite.held if key not in kept])
