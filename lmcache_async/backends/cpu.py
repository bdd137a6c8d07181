"""The CPU tier: an LRU hot cache of payloads that live in the host memory pool.

Every cached chunk holds one reference on its :class:`MemoryObj`. Eviction (asked for by the
pool when an allocation does not fit) drops least recently used entries that nobody else
references and nobody has pinned. The synchronous ``*_nowait`` methods are what the storage
manager calls on the event loop: each is a dictionary operation per key, far cheaper than a
task switch; the async methods of :class:`StorageBackend` wrap them.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import cast

import structlog

from ..errors import InvalidInputError
from ..keys import ChunkKey
from ..memory import MemoryObj, MemoryPool
from ..stats import TierStats
from .base import StorageBackend
from .lru import held_prefix_count, held_prefix_values
from .record import RecordSpec

__all__ = ["CPUBackend"]

log = structlog.get_logger(__name__)

EvictionListener = Callable[[list[ChunkKey]], None]


class CPUBackend(StorageBackend):
    """LRU map of chunk keys to payloads in ``pool``; registers itself as the pool's evictor.

    ``on_evict`` is told which keys eviction dropped (for KV events).
    """

    name = "cpu"

    def __init__(self, pool: MemoryPool, *, on_evict: EvictionListener | None = None) -> None:
        self._pool = pool
        # Keys are ChunkKeys; typed as bytes so a bare digest can probe the index.
        self._entries: collections.OrderedDict[bytes, MemoryObj] = collections.OrderedDict()
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
        self._hits += n
        if n < len(keys):
            self._misses += 1
        return n

    def get_prefix_nowait(self, keys: Sequence[bytes]) -> list[MemoryObj]:
        """Payloads of the leading keys held, each with a reference for the caller; hits
        become most recently used."""
        return [obj.ref() for obj in held_prefix_values(self._entries, keys)]

    def get_nowait(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        out: list[MemoryObj | None] = []
        for key in keys:
            obj = self._entries.get(key)
            if obj is not None:
                self._entries.move_to_end(key)
                out.append(obj.ref())
            else:
                out.append(None)
        return out

    def put_nowait(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> int:
        """Cache ``objs`` under ``keys``; a key already held keeps its payload."""
        if len(keys) != len(objs):
            raise InvalidInputError("keys and objs differ in length")
        added = 0
        for key, obj in zip(keys, objs, strict=True):
            if key in self._entries:
                self._entries.move_to_end(key)
                continue
            self._entries[key] = obj.ref()
            self._bytes += obj.nbytes
            added += 1
        self._puts += added
        return added

    def remove_nowait(self, keys: Sequence[ChunkKey]) -> int:
        removed = 0
        for key in keys:
            obj = self._entries.pop(key, None)
            if obj is not None:
                self._drop(obj)
                removed += 1
        return removed

    def clear_nowait(self) -> list[ChunkKey]:
        """Forget every entry; returns the keys that were held, oldest first."""
        keys = [cast(ChunkKey, key) for key in self._entries]
        for obj in self._entries.values():
            self._drop(obj)
        self._entries.clear()
        return keys

    def pin_prefix_nowait(self, keys: Sequence[bytes]) -> list[MemoryObj]:
        """Pin the leading keys held; returns their payloads, each referenced and pinned."""
        objs = self.get_prefix_nowait(keys)
        for obj in objs:
            obj.pin()
        return objs

    def evict(self, nbytes: int) -> int:
        """Drop unpinned, otherwise unreferenced entries, oldest first, until ``nbytes`` are
        released or none is left; returns the bytes released."""
        page = self._pool.page_size
        released = 0
        victims: list[ChunkKey] = []
        for key, obj in self._entries.items():  # oldest first
            if released >= nbytes:
                break
            if obj.pin_count == 0 and obj.ref_count == 1:
                victims.append(cast(ChunkKey, key))
                released += -(-obj.nbytes // page) * page  # whole pages go back
        for key in victims:
            self._drop(self._entries.pop(key))
        if victims:
            self._evictions += len(victims)
            log.debug("cpu_tier_evicted", chunks=len(victims), bytes=released, wanted=nbytes)
            if self._on_evict is not None:
                self._on_evict(victims)
        return released

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
        )

    async def aclose(self) -> None:
        self.clear_nowait()
        self._pool.set_evictor(None)
