"""The storage manager's removals: chunks by key, whole tiers, and tenants by erasure, with
the erasure marks that make an erasure final (:mod:`.epochs`: work marked before an erasure
of its tenant lands nothing after it). The slow tiers report the chunks they drop
themselves (:mod:`.removal_events`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.logging import get_logger

from ..errors import TierError
from . import erasure
from .base import StorageBackend
from .cpu import CPUBackend
from .epochs import ErasureEpochs
from .pins import PinSets
from .removal_events import RemovalEvents
from .tier_events import TierEvents
from .tiers import TierSet
from .writers import TierWriters

__all__ = ["Removals"]

log = get_logger(__name__)


class Removals:
    """The removal methods of :class:`~.manager.StorageManager` (its CPU tier, tiers,
    writers, pins, KV events and erasure epochs)."""

    _cpu: CPUBackend
    _tiers: TierSet
    _writers: TierWriters
    _pins: PinSets
    _kv_events: TierEvents
    _epochs: ErasureEpochs
    _removal_events: RemovalEvents
    check_locations: Callable[[Sequence[str] | None, str], tuple[str, ...]]
    _read_failed: Callable[[StorageBackend, Exception], None]

    @property
    def erasure_mark(self) -> int:
        """The erasure mark of work beginning now: hand it to :meth:`put`,
        :meth:`fetch_prefix` or :meth:`pin_objects` when that work lands (nothing of a
        tenant erased since lands then; :mod:`.epochs`)."""
        return self._epochs.mark()

    def intact(self, keys: Sequence[bytes], mark: int) -> int:
        """How many leading ``keys`` no erasure of their tenant reached since ``mark``."""
        return self._epochs.intact(keys, mark)

    def rewriting(
        self, tier: str, keys: Sequence[ChunkKey]
    ) -> contextlib.AbstractContextManager[list[ChunkKey]]:
        """Hold back the removed events of ``keys`` leaving the slow tier ``tier`` while
        they are written again; the caller extends the list it yields with the keys it
        wrote back, and the others are recorded on the way out
        (:meth:`.removal_events.RemovalEvents.rewriting`)."""
        return self._removal_events.rewriting(tier, keys)

    async def remove(self, keys: Sequence[ChunkKey], locations: Sequence[str] | None = None) -> int:
        """Forget ``keys`` in the named tiers (all by default); returns chunks removed. The
        CPU tier's removed event is recorded here, a slow tier's when the tier reports
        the keys it held."""
        names = self.check_locations(locations, "locations")
        removed = 0
        if self._cpu.name in names:
            present = [key for key in keys if key in self._cpu]
            removed += self._cpu.remove_nowait(present)
            self._kv_events.removed(present, self._cpu.name)
        for tier in self._tiers.slow:
            if tier.name in names and tier.healthy():
                try:
                    removed += await tier.remove(keys)
                except TierError as exc:
                    self._read_failed(tier, exc)
        return removed

    async def clear(self, locations: Sequence[str] | None = None) -> int:
        """Drop every chunk of the named tiers (all by default) and, for the CPU tier, every
        pin; returns the number of chunks dropped. A clear of every tier records one
        cleared event; of some, a removed event of the keys of each (a slow tier reports
        its own)."""
        names = self.check_locations(locations, "locations")
        everything = set(names) >= {self._cpu.name, *(tier.name for tier in self._tiers.slow)}
        dropped = 0
        if self._cpu.name in names:
            self._pins.release_all()
            keys = self._cpu.clear_nowait()
            if not everything:
                self._kv_events.removed(keys, self._cpu.name)
            dropped += len(keys)
        with self._removal_events.clearing_all() if everything else contextlib.nullcontext():
            for tier in self._tiers.slow:
                if tier.name in names:
                    await self._writers[tier.name].drain()
                    try:
                        dropped += await tier.clear()
                    except TierError as exc:
                        self._read_failed(tier, exc)
        if everything:
            self._kv_events.cleared()
        log.info("cache_cleared", chunks=dropped, locations=list(names))
        return dropped

    async def erase_tenant(self, tag: bytes, *, timeout: float) -> dict[str, int]:
        """Remove every chunk of the tenant with ``tag`` from every tier (one that is down
        too) and the slow-tier writes queued; the chunks removed per tier. Nothing queued
        before lands after (:func:`.erasure.erase_tenant`: it raises InvalidInputError for
        a bad tag, EraseIncompleteError when some tier could not be erased)."""
        return await erasure.erase_tenant(
            tag, self._cpu, self._writers, self._kv_events, self._epochs, timeout=timeout
        )
