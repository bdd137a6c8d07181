"""The engine's controls: tier names, re-encoding, health, flushing, clearing, erasure by
tenant, the freeze and hot-cache switches, KV events and statistics. One group of
:class:`~lmcache_async.engine.CacheEngine`'s public methods, over its parts."""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_async.keys.tokens import Tokens
from lmcache_async.tenancy.tenants import tag_hex

from ..backends.codec import Codec
from ..backends.disk import DiskBackend
from ..errors import InvalidInputError
from ..events import KVEvent
from ..stats import EngineStats, TenantStats
from .compress import reencode_prefix
from .parts import EngineBase
from .snapshot import engine_stats
from .tiers import record_spec

__all__ = ["TierControls"]


class TierControls(EngineBase):
    """What an operator does to a running engine's tiers, and what it reads of them."""

    async def compress(
        self,
        tokens: Tokens | None = None,
        method: str = "zstd",
        location: str = "disk",
        *,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
    ) -> int:
        """Re-encode the stored chunks of a prompt's cached prefix in a slow tier.

        ``method``: ``zstd`` or ``lz4`` (lossless), ``int8`` (lossy, per-channel scale) or
        ``none`` (what :meth:`decompress` uses). ``location``: ``disk`` or ``redis``. Returns
        the number of chunks re-encoded. Raises InvalidInputError for an unknown method or a
        location that is not an enabled slow tier.
        """
        self._check_open()
        codec = Codec.parse(method)
        tier = self._parts.manager.tier(location)
        if tier.name == "cpu":
            raise InvalidInputError("compress works on the disk or redis tier, not on cpu")
        manager = self._parts.manager
        mark = manager.erasure_mark
        keys, _, _ = await self._parts.keys.lookup_keys(tokens, hashes, offsets)
        return await reencode_prefix(
            tier,
            keys,
            record_spec(self._parts.config, self._parts.layout, codec, self._parts.cipher),
            batch_chunks=self._parts.config.pipeline_batch_chunks,
            intact=lambda batch: manager.intact(batch, mark),
            rewriting=manager.rewriting,
        )

    async def decompress(
        self,
        tokens: Tokens | None = None,
        location: str = "disk",
        *,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
    ) -> int:
        """Store a prompt's chunks in ``location`` without compression again (the inverse of
        :meth:`compress`; a lossy ``int8`` encoding stays as lossy as it was). Returns the
        number of chunks re-encoded."""
        return await self.compress(tokens, "none", location, hashes=hashes, offsets=offsets)

    async def check_health(self) -> dict[str, bool]:
        """Probe every tier now (instead of waiting for the monitor's next round); returns
        each tier's state."""
        self._check_open()
        if self._parts.health is not None:
            await self._parts.health.check_once()
        return self._parts.manager.tier_health()

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until chunks queued for disk and Redis are written (at most ``timeout``
        seconds, default ``store_timeout``); False when time ran out."""
        self._check_open()
        return await self._parts.manager.flush(
            self._parts.config.store_timeout if timeout is None else timeout
        )

    async def wait_disk_index(self, *, audited: bool = False) -> bool:
        """Wait until the disk tier's index covers every file of its directory (with
        ``audited``: and the sizes of the files its manifest named are checked); True at
        once without a disk tier, False when the fill stopped short (the tier closed, its
        directory unreadable). The engine serves all along: a disk chunk not indexed yet
        is looked up in its file. Bound it with ``anyio.fail_after``."""
        self._check_open()
        for tier in self._parts.manager.slow_tiers:
            if isinstance(tier, DiskBackend) and not await tier.wait_index(audited=audited):
                return False
        return True

    async def clear(self, locations: Sequence[str] | None = None) -> int:
        """Drop every cached chunk of the named tiers (default: all) and, with the CPU tier,
        every pin; returns how many chunks were dropped."""
        self._check_open()
        return await self._parts.manager.clear(self.check_locations(locations, "locations"))

    async def erase(self, tenant: str | None = None) -> dict[str, int]:
        """Remove every chunk of ``tenant`` (None: the engine's own tenant) from every tier
        (CPU, disk, Redis; a tier that is down too) and from the writes queued for the slow
        tiers; returns the chunks removed per tier.

        A tenant's chunks are found by the tag their keys start with, which depends on the
        name alone: the erasure reaches the tenant's chunks of every model in a shared disk
        directory or Redis. Nothing queued before the erasure lands after it; a lookup pin
        taken before it holds its chunks until released (they go then).

        Raises:
            InvalidInputError: ``tenant`` is not None or a valid tenant name.
            EraseIncompleteError: some tier could not be erased; its ``removed`` has the
                other tiers' counts, its ``failed`` why each of these failed. Erase again.
            EngineClosedError: the engine is closed.
        """
        self._check_open()
        parts = self._parts
        tag = parts.hashers.tag(tenant)
        return await parts.manager.erase_tenant(tag, timeout=parts.config.store_timeout)

    def freeze(self, enabled: bool) -> None:
        """Freeze mode: stores write nothing; lookups and retrieves are still served."""
        self._check_open()
        self._parts.manager.freeze(enabled)

    def set_hot_cache(self, enabled: bool) -> None:
        """Switch the CPU hot cache: when off, stores keep nothing new in host memory."""
        self._check_open()
        self._parts.manager.set_hot_cache(enabled)

    @property
    def accepts_writes(self) -> bool:
        """Whether a store could keep anything now (open, healthy, not frozen, and some
        target tier takes writes)."""
        return not self._parts.closed and self._parts.manager.accepts_writes and self.is_healthy()

    def take_events(self) -> list[KVEvent]:
        """Return and forget the KV events (chunks stored / removed) recorded so far."""
        return self._parts.events.take()

    @property
    def events_dropped(self) -> int:
        """KV events dropped, oldest first, because nobody took them in time (the buffer
        is bounded by ``max_kv_events`` and ``max_kv_event_bytes``)."""
        return self._parts.events.dropped

    async def wait_events(self) -> None:
        """Return once at least one KV event is waiting for :meth:`take_events` (never
        while events are disabled: bound it with a cancel scope)."""
        await self._parts.events.wait()

    def stats(self) -> EngineStats:
        """A snapshot of traffic, memory, tiers and switches, and the figures by tenant
        (``tenants``: lookups, and what each tier holds, evicted and erased of each)."""
        parts = self._parts
        return engine_stats(
            parts.counters,
            parts.pool,
            parts.manager,
            parts.events,
            healthy=self.is_healthy(),
            labels=parts.config.tenant_labels,
            costs=parts.costs,
        )

    def tenant_stats(self, tenant: str | None = None) -> TenantStats:
        """The figures of ``tenant`` (None: the engine's own tenant); zeros for a tenant
        neither looked up nor held.

        Raises:
            InvalidInputError: ``tenant`` is not None or a valid tenant name.
        """
        parts = self._parts
        tag = tag_hex(parts.hashers.tag(tenant))
        figures = self.stats().tenants
        return next((t for t in figures.values() if t.tag == tag), TenantStats(tag=tag))
