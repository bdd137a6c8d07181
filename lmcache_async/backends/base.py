"""The interface every storage tier implements."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.memory.pool import MemoryObj

from ..stats import TierStats
from .record import RecordSpec

__all__ = ["RemovalListener", "StorageBackend", "leading_run"]

RemovalListener = Callable[[Sequence[ChunkKey]], None]
"""Told the keys of chunks that left a tier (see :meth:`StorageBackend.set_removal_listener`)."""


class StorageBackend(abc.ABC):
    """A tier of the cache: a map from chunk keys to payloads.

    Objects returned by :meth:`get` carry one reference for the caller, who must
    ``unref()`` them. :meth:`put` takes references of its own; the caller keeps its own.
    Dependency errors are mapped to :class:`~lmcache_async.errors.TierError` here, at the
    boundary.
    """

    name: str
    _removal_listener: RemovalListener | None = None

    def set_removal_listener(self, listener: RemovalListener | None) -> None:
        """Tell ``listener`` the keys of the chunks that leave this tier (None: tell no
        one, the default), for the KV events of a KV-aware router.

        The disk and Redis tiers call it synchronously, on the event loop, once the chunks
        are gone: the ones they evict (capacity, a tenant's quota), delete as corrupt,
        remove, clear or erase. It must not raise or block. It hears only what this client
        deletes: Redis' own ``maxmemory`` eviction and TTL expiry happen in the server,
        unseen (keyspace notifications are not used). The CPU tier reports its evictions
        through :meth:`~.cpu.CPUBackend.set_eviction_listener` instead.
        """
        self._removal_listener = listener

    def _report_removed(self, keys: Sequence[ChunkKey]) -> None:
        """Tell the removal listener that ``keys`` left the tier (nothing when empty)."""
        listener = self._removal_listener
        if listener is not None and keys:
            listener(keys)

    @abc.abstractmethod
    async def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """Number of leading ``keys`` this tier holds."""

    @abc.abstractmethod
    async def get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """The payload of each key, or None where the tier does not hold it."""

    async def get_prefix(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        """The payloads of the leading run of ``keys`` this tier returns, each with one
        reference for the caller: the run stops at the first key the tier does not hold,
        cannot read or finds corrupt. No :meth:`contains_prefix` is needed first.

        By default :meth:`get` with whatever follows its first None released; a tier that
        can tell sooner where its run ends overrides this to read no further.

        Raises:
            As :meth:`get`.
        """
        return leading_run(await self.get(keys))

    @abc.abstractmethod
    async def put(
        self,
        keys: Sequence[ChunkKey],
        objs: Sequence[MemoryObj],
        *,
        spec: RecordSpec | None = None,
    ) -> int:
        """Store payloads under keys (existing keys are kept); returns how many were added.

        ``spec`` (slow tiers) overrides how records are encoded for this call."""

    @abc.abstractmethod
    async def remove(self, keys: Sequence[ChunkKey]) -> int:
        """Forget the given keys; returns how many were held."""

    @abc.abstractmethod
    async def clear(self) -> int:
        """Forget everything; returns how many chunks were held."""

    @abc.abstractmethod
    async def erase_tenant(self, tag: bytes) -> int:
        """Remove every chunk of the tenant with ``tag`` (the first
        :data:`~lmcache_async.tenancy.tenants.TAG_BYTES` bytes of its keys), found by a key prefix
        or an index, never by a scan of what is not this tier's; returns how many were
        removed. A chunk pinned now is removed when its pins end (and counted)."""

    @abc.abstractmethod
    def healthy(self) -> bool:
        """Whether the tier can serve requests now."""

    async def check_health(self) -> bool:
        """Probe the tier (the health monitor calls this); by default, :meth:`healthy`."""
        return self.healthy()

    @abc.abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of the tier's counters."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release everything the tier holds."""


def leading_run(got: Sequence[MemoryObj | None]) -> list[MemoryObj]:
    """The objects of ``got`` before its first None; those after it are released."""
    run: list[MemoryObj] = []
    for obj in got:
        if obj is None:
            break
        run.append(obj)
    for obj in got[len(run) :]:
        if obj is not None:
            obj.unref()
    return run
