"""The CPU tier: an LRU hot cache of payloads that live in the host memory pool.

Every cached chunk holds one reference on its :class:`MemoryObj`. Eviction (asked for by the
pool when an allocation does not fit) drops least recently used entries that nobody else
references and nobody has pinned.

*Tenants* (:mod:`.tenant_ledger`): usage is accounted per tenant tag. With quotas
(``limits``), a put of a tenant first evicts that tenant's own least recently used chunks
so that it stays within its quota (a chunk that cannot fit is not stored, and counted), and
the pool's eviction never takes a chunk of a tenant within its quota. :meth:`erase_tenant`
drops a tenant's chunks at once, pinned or not: a pinned chunk's memory is freed when its
last pin and reference end, and no lookup finds it meanwhile.

The synchronous ``*_nowait`` methods are what the storage manager calls on the event loop:
each is a dictionary operation per key, far cheaper than a task switch; the async methods
of :class:`StorageBackend` wrap them.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import cast

from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import MemoryObj, MemoryPool
from lmcache_async.tenancy.tenants import TAG_BYTES, TenantLimits, tag_hex

from ..errors import InvalidInputError
from ..stats import TierStats
from .base import StorageBackend
from .lru import held_prefix_count, held_prefix_values
from .record import RecordSpec
from .tenant_ledger import TenantLedger, check_tag

__all__ = ["CPUBackend"]

log = get_logger(__name__)

EvictionListener = Callable[[list[ChunkKey]], None]


class CPUBackend(StorageBackend):
    """LRU map of chunk keys to payloads in ``pool``; registers itself as the pool's evictor.

    ``on_evict`` is told which keys eviction dropped (for KV events), quota evictions
    included. ``limits``: the tenants' quotas in this tier (none by default).
    """

    name = "cpu"

    def __init__(
        self,
        pool: MemoryPool,
        *,
        on_evict: EvictionListener | None = None,
        limits: TenantLimits | None = None,
    ) -> None:
        self._pool = pool
        # Keys are ChunkKeys; typed as bytes so a bare digest can probe the index.
        self._entries: collections.OrderedDict[bytes, MemoryObj] = collections.OrderedDict()
        # Without quotas the ledger only counts per tenant, finding keys here.
        self._ledger = TenantLedger(limits, index=self._entries)
        self._bytes = 0
        self._on_evict = on_evict
        self._hits = 0
        self._misses = 0
        self._puts = 0
        self._evictions = 0
        pool.set_evictor(self.evict)

    # -- synchronous core ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def contains_prefix_nowait(self, keys: Sequence[bytes]) -> int:
        """Number of leading keys held; hits become most recently used."""
        n = held_prefix_count(self._entries, keys)
        if n and self._ledger.active:
            self._ledger.touch(keys, n)
        self._hits += n
        if n < len(keys):
            self._misses += 1
        return n

    def get_prefix_nowait(self, keys: Sequence[bytes]) -> list[MemoryObj]:
        """Payloads of the leading keys held, each with a reference for the caller; hits
        become most recently used."""
        objs = held_prefix_values(self._entries, keys)
        if objs and self._ledger.active:
            self._ledger.touch(keys, len(objs))
        return [obj.ref() for obj in objs]

    def get_nowait(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        out: list[MemoryObj | None] = []
        per_tenant = self._ledger.active
        for key in keys:
            obj = self._entries.get(key)
            if obj is not None:
                self._entries.move_to_end(key)
                if per_tenant:
                    self._ledger.touch_one(key)
                out.append(obj.ref())
            else:
                out.append(None)
        return out

    def put_nowait(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> int:
        """Cache ``objs`` under ``keys``; a key already held keeps its payload.

        A tenant with a quota first loses its own least recently used evictable chunks
        until the new one fits; a chunk that cannot fit (larger than the quota, or the
        quota held by pinned or referenced chunks) is not stored and is counted in
        :attr:`quota_refusals`. Returns how many chunks were added.
        """
        if len(keys) != len(objs):
            raise InvalidInputError("keys and objs differ in length")
        ledger = self._ledger
        added = 0
        quota_evicted: list[ChunkKey] = []
        for key, obj in zip(keys, objs, strict=True):
            if key in self._entries:
                self._entries.move_to_end(key)
                if ledger.active:
                    ledger.touch_one(key)
                continue
            if ledger.active:
                own = ledger.victims(key[:TAG_BYTES], obj.nbytes, self._evictable)
                if own is None:
                    ledger.refuse(key)
                    continue
                for victim in own:
                    self._evict_entry(victim)
                    quota_evicted.append(cast(ChunkKey, victim))
            self._entries[key] = obj.ref()
            self._bytes += obj.nbytes
            ledger.add(key, obj.nbytes)
            added += 1
        self._puts += added
        if quota_evicted:
            log.debug("cpu_tier_quota_evicted", chunks=len(quota_evicted))
            self._evicted(quota_evicted)
        return added

    def remove_nowait(self, keys: Sequence[ChunkKey]) -> int:
        removed = 0
        for key in keys:
            obj = self._entries.pop(key, None)
            if obj is not None:
                self._ledger.remove(key, obj.nbytes)
                self._drop(obj)
                removed += 1
        return removed

    def clear_nowait(self) -> list[ChunkKey]:
        """Forget every entry; returns the keys that were held, oldest first."""
        keys = [cast(ChunkKey, key) for key in self._entries]
        for obj in self._entries.values():
            self._drop(obj)
        self._entries.clear()
        self._ledger.clear()
        return keys

    def erase_tenant_nowait(self, tag: bytes) -> list[ChunkKey]:
        """Drop every chunk of the tenant with ``tag``; returns their keys.

        A chunk pinned or referenced now is dropped from the index at once (no lookup
        finds it any more) and its memory returns to the pool when its last pin and
        reference end.

        Raises:
            InvalidInputError: ``tag`` is not a tenant tag.
        """
        keys = self._ledger.erase(check_tag(tag))
        in_use = 0
        for key in keys:
            obj = self._entries.pop(key)
            in_use += obj.pin_count > 0 or obj.ref_count > 1
            self._drop(obj)
        if keys:
            log.info("cpu_tier_tenant_erased", tag=tag_hex(tag), chunks=len(keys), in_use=in_use)
        return [cast(ChunkKey, key) for key in keys]

    def pin_prefix_nowait(self, keys: Sequence[bytes]) -> list[MemoryObj]:
        """Pin the leading keys held; returns their payloads, each referenced and pinned."""
        objs = self.get_prefix_nowait(keys)
        for obj in objs:
            obj.pin()
        return objs

    def admit_pins(
        self, keys: Sequence[bytes], objs: Sequence[MemoryObj]
    ) -> tuple[int, list[tuple[bytes, int]]]:
        """How many leading ``objs`` (payloads read for a lookup, about to be pinned for it
        under ``keys``) their tenants' quotas take, and what each pin outside the tier was
        charged, ``(tag, bytes)``, for :meth:`release_pins` when the pins end.

        Pins count against the tenant's quota: a payload the tier holds as its entry is
        counted already; any other is charged to its tenant, first evicting the tenant's
        own least recently used evictable chunks to make room. The first that cannot fit
        ends the run; it and those after it are counted as refused pins. A tenant with no
        quota is charged nothing.
        """
        ledger = self._ledger
        charges: list[tuple[bytes, int]] = []
        if not ledger.active:
            return len(objs), charges
        quota_evicted: list[ChunkKey] = []
        admitted = len(objs)
        for i, (key, obj) in enumerate(zip(keys, objs, strict=False)):
            tag = key[:TAG_BYTES]
            if self._entries.get(key) is obj or ledger.limit(tag) is None:
                continue
            own = ledger.victims(tag, obj.nbytes, self._evictable)
            if own is None:
                admitted = i
                break
            for victim in own:
                self._evict_entry(victim)
                quota_evicted.append(cast(ChunkKey, victim))
            ledger.charge_pin(tag, obj.nbytes)
            charges.append((tag, obj.nbytes))
        for key in keys[admitted : len(objs)]:
            ledger.refuse_pins(key[:TAG_BYTES], 1)
        if admitted < len(objs):
            log.debug("cpu_tier_pins_refused", chunks=len(objs) - admitted)
        if quota_evicted:
            self._evicted(quota_evicted)
        return admitted, charges

    def release_pins(self, charges: Sequence[tuple[bytes, int]]) -> None:
        """The pins :meth:`admit_pins` charged have ended."""
        for tag, nbytes in charges:
            self._ledger.release_pin(tag, nbytes)

    def evict(self, nbytes: int) -> int:
        """Drop unpinned, otherwise unreferenced entries, oldest first, until ``nbytes`` are
        released or none is left; returns the bytes released. A chunk of a tenant within
        its quota is never dropped."""
        if self._ledger.active:
            victims, released = self._ledger.pick_unprotected(
                self._entries, nbytes, evictable=self._evictable, round_to=self._pool.page_size
            )  # whole pages go back to the pool
        else:
            victims, released = self._oldest_evictable(nbytes)
        for key in victims:
            self._evict_entry(key)
        if victims:
            log.debug("cpu_tier_evicted", chunks=len(victims), bytes=released, wanted=nbytes)
            self._evicted([cast(ChunkKey, key) for key in victims])
        return released

    def _oldest_evictable(self, nbytes: int) -> tuple[list[bytes], int]:
        """The oldest entries nobody else holds, until they release ``nbytes`` (in whole
        pages); with the bytes they release. No quota protects anyone here."""
        page = self._pool.page_size
        victims: list[bytes] = []
        released = 0
        for key, obj in self._entries.items():
            if released >= nbytes:
                break
            if obj.pin_count == 0 and obj.ref_count == 1:
                victims.append(key)
                released += obj.npages * page
        return victims, released

    def _evictable(self, key: bytes) -> bool:
        obj = self._entries[key]
        return obj.pin_count == 0 and obj.ref_count == 1

    def _evict_entry(self, key: bytes) -> None:
        obj = self._entries.pop(key)
        self._ledger.evicted(key, obj.nbytes)
        self._drop(obj)

    def _evicted(self, keys: list[ChunkKey]) -> None:
        self._evictions += len(keys)
        if self._on_evict is not None:
            self._on_evict(keys)

    def set_eviction_listener(self, listener: EvictionListener | None) -> None:
        """Tell ``listener`` which keys each eviction drops."""
        self._on_evict = listener

    def _drop(self, obj: MemoryObj) -> None:
        self._bytes -= obj.nbytes
        obj.unref()

    # -- StorageBackend -----------------------------------------------------------------

    async def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        return self.contains_prefix_nowait(keys)

    async def get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        return self.get_nowait(keys)

    async def get_prefix(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        return self.get_prefix_nowait(keys)

    async def put(
        self,
        keys: Sequence[ChunkKey],
        objs: Sequence[MemoryObj],
        *,
        spec: RecordSpec | None = None,
    ) -> int:
        return self.put_nowait(keys, objs)

    async def remove(self, keys: Sequence[ChunkKey]) -> int:
        return self.remove_nowait(keys)

    async def clear(self) -> int:
        return len(self.clear_nowait())

    async def erase_tenant(self, tag: bytes) -> int:
        """:meth:`erase_tenant_nowait`; returns how many chunks were dropped."""
        return len(self.erase_tenant_nowait(tag))

    @property
    def quota_refusals(self) -> int:
        """Chunks not stored because their tenant's quota could not take them."""
        return self._ledger.refused

    @property
    def ledger(self) -> TenantLedger:
        """The tier's accounts by tenant."""
        return self._ledger

    def healthy(self) -> bool:
        return not self._pool.closed

    def stats(self) -> TierStats:
        return TierStats(
            name=self.name,
            chunks=len(self._entries),
            bytes=self._bytes,
            hits=self._hits,
            misses=self._misses,
            puts=self._puts,
            evictions=self._evictions,
            healthy=self.healthy(),
            tenants=MappingProxyType(self._ledger.usage()),
        )

    async def aclose(self) -> None:
        self.clear_nowait()
        self._pool.set_evictor(None)
