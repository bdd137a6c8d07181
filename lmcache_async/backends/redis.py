"""The Redis/Valkey tier: one self-describing record per chunk, shared by many hosts.

Each chunk is one string value, ``record header ‖ payload``
(:mod:`~lmcache_async.backends.record`), written by a single ``SET`` so a reader sees a
whole record or nothing. Keys are ``<key_prefix><ChunkKey.to_str()>``: the chunk key already
binds model, weights and KV layout, so engines of different models share a server safely.

Batches travel through pipelines: one round trip of ``EXISTS`` for a prefix lookup, of
``GET`` for a read, split into sub-batches of about ``batch_bytes`` so that what is asked
of the server at once stays bounded; a write's ``SET NX`` commands are pipelined
one after the other, its answers counted in batches four times smaller. The values
themselves travel on the tier's own connections (:mod:`.redis_wire`): a fetched value is
received straight into the pool object it becomes, its checksum computed as the bytes land
(:mod:`.redis_records`), and a record is written from its object's memory, its checksum
computed in a worker thread while the record before it is sent (:mod:`.redis_put`). On a cluster
(``redis-cluster://``) each primary's keys go on a connection to it, the primaries at once.

Every call runs under a deadline, and connection errors and timeouts mark the tier
unhealthy until :meth:`RedisBackend.check_health` gets an answer again
(:mod:`.redis_conn`, which also parses ``remote_url``). Tenant quotas are kept in the server
(shared by every host) and tenants are erased by key prefix (:mod:`.redis_tenants`).

The removal listener (:meth:`StorageBackend.set_removal_listener`) is told every chunk
this client deletes: evicted for a tenant's quota, refused by it after the write, found
corrupt, removed, cleared or erased (the last two page by page, as the ``SCAN`` finds
them). Chunks the server drops itself (``maxmemory`` eviction, TTL expiry) or another host
deletes are not seen, hence not told.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Final

from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import MemoryObj, MemoryPool, current_budget
from lmcache_async.tenancy.tenants import TenantLimits

from ..errors import ConfigError, InvalidInputError, TierError
from ..stats import TierStats
from .base import StorageBackend, leading_run
from .counters import TierCounters
from .record import RecordSpec
from .redis_conn import DEFAULT_TIMEOUT, RedisConnection, RedisTarget, parse_remote_url
from .redis_put import RecordWriter
from .redis_records import RecordLoader
from .redis_tenants import TenantIndex, glob_escape, key_of_member

__all__ = [
    "DEFAULT_BATCH_BYTES",
    "PUT_SPLIT",
    "DEFAULT_KEY_PREFIX",
    "DEFAULT_TIMEOUT",
    "RedisBackend",
    "RedisTarget",
    "parse_remote_url",
]

log = get_logger(__name__)

DEFAULT_KEY_PREFIX: Final = "lmca:"
"""Prefix of every key this tier writes; :meth:`RedisBackend.clear` deletes only these."""

DEFAULT_BATCH_BYTES: Final = 32 * 1024 * 1024
"""Bytes of values per pipelined round trip."""

PUT_SPLIT: Final = 4
"""A put counts what the server stored, and keeps the tenants' quotas, in batches this many
times smaller than ``batch_bytes`` (its records go out pipelined regardless)."""


def _positive(value: object, name: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(name, f"expected a positive number of seconds, got {value!r}")
    return float(value)


class RedisBackend(StorageBackend):
    """The Redis/Valkey tier, standalone or cluster. Build it with :meth:`open`.

    ``timeout`` (config ``remote_timeout``) bounds every connect, socket read and write and
    small call; ``ttl`` (``remote_ttl``) makes entries expire that many seconds after they
    are written (None: never). ``batch_bytes`` caps the values asked for per round trip.
    :meth:`stats` counts what this client saw: ``chunks`` and ``bytes`` are entries it added
    and has not removed, since the server is shared and entries may expire.

    ``limits`` gives tenants quotas of record bytes, kept in the server's index and shared
    by every host that uses the same server and prefix (:mod:`.redis_tenants`): a put
    that takes a tenant over its quota evicts the tenant's least recently used chunks (a
    chunk larger than the quota is not written), and hits refresh their last use. Redis'
    own ``maxmemory`` eviction is outside the quotas: with them, use a
    ``maxmemory-policy`` of ``noeviction`` or ``volatile-*``. ``stats().tenants`` has
    each tenant this client has seen: for one with a quota, the count and bytes the
    server's index reported to this client's last write, hit or removal of it (every
    host's chunks); for the others, what this client added and has not removed.
    ``evictions`` counts chunks this client evicted to keep a quota, and
    :attr:`quota_refusals` those it did not store, each larger than its tenant's quota.

    Raises:
        ConfigError: a bad URL (``remote_url``), timeout (``remote_timeout``), TTL
            (``remote_ttl``), key prefix (``remote_key_prefix``), batch size or
            ``limits`` (``tenant_quotas.redis``).
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        pool: MemoryPool,
        spec: RecordSpec,
        allocation_timeout: float,
        timeout: float = DEFAULT_TIMEOUT,
        ttl: float | None = None,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        limits: TenantLimits | None = None,
    ) -> None:
        target = parse_remote_url(url)
        timeout = _positive(timeout, "remote_timeout")
        self._ttl_ms = None if ttl is None else max(1, round(_positive(ttl, "remote_ttl") * 1000))
        if not isinstance(key_prefix, str) or not key_prefix:
            raise ConfigError("remote_key_prefix", f"expected a non-empty str, got {key_prefix!r}")
        self._prefix = key_prefix.encode()
        if isinstance(batch_bytes, bool) or not isinstance(batch_bytes, int) or batch_bytes <= 0:
            raise ConfigError("remote_batch_bytes", f"expected an int > 0, got {batch_bytes!r}")
        self._spec = spec
        self._loader = RecordLoader(pool, spec, allocation_timeout)
        self._chunk_bytes = max(1, math.prod(spec.shape_of(spec.max_tokens)) * spec.dtype.itemsize)
        self._batch_keys = max(1, batch_bytes // self._chunk_bytes)
        self._counts = TierCounters()
        self._conn = RedisConnection(target, timeout=timeout, counters=self._counts)
        self._tenants = TenantIndex(self._conn, self._prefix, limits, self._ttl_ms)
        self._writer = RecordWriter(self._conn, self._ttl_ms, self._stored)
        self._chunks = self._bytes = 0

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        pool: MemoryPool,
        spec: RecordSpec,
        allocation_timeout: float,
        timeout: float = DEFAULT_TIMEOUT,
        ttl: float | None = None,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        limits: TenantLimits | None = None,
    ) -> RedisBackend:
        """Validate the settings, connect and probe the server once; with quotas, check
        that none is larger than the server's ``maxmemory`` (a cluster's: its primaries').

        A server that does not answer yet is not an error: the tier starts unhealthy and
        the health monitor brings it in when :meth:`check_health` succeeds (unchecked).

        Raises:
            ConfigError: a bad setting (see the class), or a quota over ``maxmemory``
                (field ``tenant_quotas.redis``).
        """
        backend = cls(
            url,
            pool=pool,
            spec=spec,
            allocation_timeout=allocation_timeout,
            timeout=timeout,
            ttl=ttl,
            key_prefix=key_prefix,
            batch_bytes=batch_bytes,
            limits=limits,
        )
        try:
            if await backend.check_health():
                await backend._tenants.check_capacity()
            else:
                log.warning("redis_tier_unreachable_at_start", url=backend._conn.target.display)
        except BaseException:
            await backend.aclose()
            raise
        return backend

    def _key(self, key: ChunkKey) -> bytes:
        return self._prefix + key.to_str().encode()

    def _batches(self, n: int) -> list[range]:
        step = self._batch_keys
        return [range(i, min(n, i + step)) for i in range(0, n, step)]

    # -- StorageBackend -------------------------------------------------------------------

    async def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """Number of leading ``keys`` stored (one pipelined EXISTS round trip).

        Raises:
            TierUnavailableError: Redis is unreachable or did not answer in time.
            TierError: Redis reported another error.
        """
        if not keys:
            return 0
        n = 0
        for present in await self._conn.exists([self._key(k) for k in keys]):
            if not present:
                break
            n += 1
        return n

    async def get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """Fetch, verify and decode each key's record into a pool object (one reference
        each for the caller); None where missing, corrupt, or no memory came in time.

        Raises:
            TierUnavailableError: Redis is unreachable or did not answer in time.
            TierError: Redis reported another error.
            EngineClosedError: the tier or the pool is closed.
        """
        out = await self._get(keys, prefix=False)
        await self._touch(out, keys)
        self._counts.got(len(keys), sum(obj is not None for obj in out))
        return out

    async def get_prefix(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        """The leading run of ``keys`` stored, read with GETs alone (no EXISTS first).

        The run ends at the first value missing, corrupt, or left when memory ran out
        (that key counts as a miss, the keys after it not at all). Values after it are
        not allocated (on a cluster, where the primaries answer at once, another
        primary's may have been by then, and are released), and no batch after its batch
        is asked for.

        Raises:
            As :meth:`get`.
        """
        run = leading_run(await self._get(keys, prefix=True))
        await self._touch(run, keys[: len(run)])
        self._counts.got(min(len(keys), len(run) + 1), len(run))
        return run

    async def _touch(self, got: Sequence[MemoryObj | None], keys: Sequence[ChunkKey]) -> None:
        """Refresh the last use of the hits (tenants with a quota only)."""
        if not self._tenants.active:
            return
        try:
            await self._tenants.touch(
                [k for k, obj in zip(keys, got, strict=True) if obj is not None]
            )
        except BaseException:
            for obj in got:
                if obj is not None:
                    obj.unref()
            raise

    async def _get(self, keys: Sequence[ChunkKey], *, prefix: bool) -> list[MemoryObj | None]:
        """Fetch and load ``keys`` batch by batch, each value into its object as it
        arrives; with ``prefix``, load nothing past the first value missing or corrupt,
        and fetch no batch after it. Under a request's
        :class:`~lmcache_async.memory.pool.AllocationBudget`, no batch is fetched once the
        request can take no more memory (its values would find no room)."""
        out: list[MemoryObj | None] = [None] * len(keys)
        loads = self._loader.loads(keys, out, prefix=prefix)
        budget = current_budget()
        reported = 0
        try:
            for batch in self._batches(len(keys)):
                if budget is not None and budget.exhausted:
                    break
                rkeys = [self._key(keys[i]) for i in batch]
                await self._conn.get_records(rkeys, batch, loads, len(rkeys) * self._chunk_bytes)
                if len(loads.bad) > reported:
                    bad = loads.bad[reported:]
                    reported = len(loads.bad)
                    await self._drop_corrupt([(keys[i], why, foreign) for i, why, foreign in bad])
                if loads.stop <= batch[-1]:
                    break
        except BaseException:
            for obj in out:
                if obj is not None:
                    obj.unref()
            raise
        return out

    async def _drop_corrupt(self, entries: Sequence[tuple[ChunkKey, str, bool]]) -> None:
        """Count unreadable entries and delete the corrupt ones; a record sealed under
        another key (``foreign``) stays, for the engines that hold that key."""
        for key, reason, _ in entries:
            log.warning("tier_entry_corrupt", tier=self.name, key=key.to_str(), reason=reason)
        self._counts.corrupt += len(entries)
        corrupt = [key for key, _, foreign in entries if not foreign]
        if not corrupt:
            return
        try:
            gone = await self._conn.unlink_each([self._key(key) for key in corrupt])
            self._report_removed([key for key, was in zip(corrupt, gone, strict=True) if was])
            await self._tenants.removed(corrupt, gone)
        except TierError as exc:
            # The read already missed; a later read finds the entry corrupt again.
            log.warning("redis_corrupt_delete_failed", chunks=len(entries), error=str(exc))

    async def put(
        self,
        keys: Sequence[ChunkKey],
        objs: Sequence[MemoryObj],
        *,
        spec: RecordSpec | None = None,
    ) -> int:
        """Write each payload not stored yet (existing keys are kept); returns how many
        were added. The caller keeps its references; this takes its own until the bytes
        are sent. ``spec`` overrides the tier's record spec for these writes (another
        codec, used by the engine's ``compress``); it must describe the same layout.

        Raises:
            InvalidInputError: ``keys`` and ``objs`` differ in length.
            TierUnavailableError: Redis is unreachable or did not answer in time.
            TierError: Redis reported another error.
        """
        if len(keys) != len(objs):
            raise InvalidInputError(f"{len(keys)} keys but {len(objs)} objects")
        if not keys:
            return 0
        rkeys = [self._key(k) for k in keys]

        async def plan() -> list[list[int]]:
            # Skipping stored keys saves sending their payloads; SET NX guards the race.
            present = await self._conn.exists(rkeys)
            todo = self._tenants.admit(keys, objs, [i for i, p in enumerate(present) if not p])
            step = -(-self._batch_keys // PUT_SPLIT)
            return [todo[i : i + step] for i in range(0, len(todo), step)]

        return await self._writer.write(keys, objs, rkeys, spec or self._spec, plan)

    async def _stored(
        self, keys: Sequence[ChunkKey], sizes: Sequence[int], replies: Sequence[Any]
    ) -> int:
        """Count the records of one batch that the server stored, and keep their
        tenants' quotas (deleting what they evict or refuse); returns how many were new."""
        new = [(k, size) for k, size, ok in zip(keys, sizes, replies, strict=True) if ok]
        recorded = await self._tenants.stored(new)
        added = len(new) - len(recorded.refused)
        self._bytes += sum(size for _, size in new) - recorded.refused_bytes
        self._chunks += added
        self._forget(len(recorded.evicted))
        self._counts.puts += added
        self._report_removed(recorded.evicted + recorded.refused)
        return added

    async def remove(self, keys: Sequence[ChunkKey]) -> int:
        """Delete the given keys; returns how many were stored.

        Raises:
            TierUnavailableError: Redis is unreachable or did not answer in time.
            TierError: Redis reported another error.
        """
        if not keys:
            return 0
        gone = await self._conn.unlink_each([self._key(k) for k in keys])
        self._forget(sum(gone))
        self._report_removed([key for key, was in zip(keys, gone, strict=True) if was])
        await self._tenants.removed(keys, gone)
        return sum(gone)

    async def clear(self) -> int:
        """Delete every key under this tier's prefix (on every cluster node), tenant
        indexes included; returns how many there were, indexes not counted. The chunk
        keys among them are told to the removal listener page by page.

        Raises:
            TierUnavailableError: Redis is unreachable or did not answer in time.
            TierError: Redis reported another error.
        """
        pattern = glob_escape(self._prefix.decode()) + "*"
        removed = await self._conn.unlink_matching(
            pattern, self._tenants.is_chunk_key, self._report_deleted
        )
        self._chunks = self._bytes = 0
        self._tenants.cleared()
        return removed

    async def erase_tenant(self, tag: bytes) -> int:
        """Delete every record of the tenant with ``tag``, of every model and host, found
        by key prefix (a ``SCAN`` of every primary, page by page, each page under the
        deadline), and its quota index; returns how many records there were.

        Raises:
            InvalidInputError: ``tag`` is not a tenant tag (16 bytes).
            TierUnavailableError: Redis is unreachable or did not answer in time.
            TierError: Redis reported another error.
        """
        erased = await self._tenants.erase(tag, self._report_deleted)
        self._forget(erased)
        return erased

    def _report_deleted(self, rkeys: list[bytes]) -> None:
        """Tell the removal listener the chunks of Redis keys this client deleted (keys
        under the prefix that name no chunk are left out)."""
        if self._removal_listener is None:
            return
        cut = len(self._prefix)
        keys = [key for key in (key_of_member(rkey[cut:]) for rkey in rkeys) if key is not None]
        self._report_removed(keys)

    def _forget(self, removed: int) -> None:
        if self._chunks:
            self._bytes -= self._bytes * min(removed, self._chunks) // self._chunks
        self._chunks = max(0, self._chunks - removed)

    def healthy(self) -> bool:
        """False from a call that could not reach Redis until :meth:`check_health`
        reaches it again (and after :meth:`aclose`)."""
        return self._conn.healthy

    async def check_health(self) -> bool:
        """PING the server (every primary of a cluster) within the timeout; updates
        :meth:`healthy`. Never raises for an unreachable server."""
        return await self._conn.ping()

    def stats(self) -> TierStats:
        stats = self._counts.stats(
            self.name,
            chunks=self._chunks,
            nbytes=self._bytes,
            evictions=self._tenants.evictions,
            healthy=self.healthy(),
        )
        return dataclasses.replace(stats, tenants=self._tenants.usage())

    @property
    def quota_refusals(self) -> int:
        """Chunks this client did not store, each larger than its tenant's quota."""
        return self._tenants.refused

    async def aclose(self) -> None:
        """Close the connections (idempotent); later calls raise EngineClosedError."""
        await self._conn.aclose()
