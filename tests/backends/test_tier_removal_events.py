"""The slow tiers report the chunks they drop, and the storage manager records each as one
removed KV event of that tier: disk evictions (capacity, a tenant's quota), Redis quota
evictions (of earlier writes, and of the write's own chunks: removed after its stored
event), corrupt records deleted on a read, a tenant's erasure, a clear of some tiers, an
explicit remove (once per tier, never twice). Against a real directory and a real
redis-server; every test ends with the pool empty."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio

from lmcache_async.backends.cpu import CPUBackend
from lmcache_async.backends.disk import DiskBackend
from lmcache_async.backends.manager import StorageManager
from lmcache_async.backends.redis import DEFAULT_KEY_PREFIX, RedisBackend
from lmcache_async.backends.removal_events import PROBE_TAG, RemovalEvents
from lmcache_async.backends.tier_events import TierEvents
from lmcache_async.events import EventBuffer, EventKind, KVEvent
from lmcache_async.keys.chunks import ChunkHasher, ChunkKey, ChunkSpan, Namespace
from lmcache_async.memory.pool import MemoryObj, MemoryPool
from lmcache_async.tenancy.quotas import TierQuota
from lmcache_async.tenancy.tenants import TenantLimits, tenant_tag
from tests.backends.test_redis import CHUNK, PAGE, filled, make_layout, make_spec
from tests.servers import RedisServer

pytestmark = pytest.mark.subprocess

TIMEOUT = 20
LAYOUT = make_layout()
SPEC = make_spec(LAYOUT)
PAYLOAD = math.prod(LAYOUT.payload_shape(CHUNK)) * LAYOUT.dtype.itemsize
HEADROOM = 1000
"""More than a record header, less than a payload: ``n * PAYLOAD + HEADROOM`` holds
exactly ``n`` records."""


def spans_of(tenant: str, n_chunks: int, seed: int = 0) -> list[ChunkSpan]:
    namespace = Namespace(model_name="m", layout_fingerprint="fp", tenant_salt=tenant)
    tokens = [seed * 100_000 + i for i in range(CHUNK * n_chunks)]
    return ChunkHasher(namespace, chunk_size=CHUNK).spans(tokens)


def digests(spans: Sequence[ChunkSpan]) -> list[bytes]:
    return [span.key.digest for span in spans]


def removed(events: Sequence[KVEvent]) -> list[tuple[str, list[bytes]]]:
    """The removed events, as ``(medium, digests)`` in the order recorded."""
    return [(e.medium, list(e.block_hashes)) for e in events if e.kind == EventKind.REMOVED]


def rkey(key: ChunkKey) -> bytes:
    return (DEFAULT_KEY_PREFIX + key.to_str()).encode()


def limits(**quotas: int) -> TenantLimits:
    return TenantLimits(TierQuota(named=quotas, default=None))


@dataclass
class Tiers:
    """A storage manager over the CPU tier and real slow tiers, writing behind."""

    pool: MemoryPool
    manager: StorageManager
    events: EventBuffer
    disk: DiskBackend | None
    redis: RedisBackend | None

    async def put(
        self, spans: Sequence[ChunkSpan], locations: Sequence[str] | None = None, seed: int = 0
    ) -> None:
        """Store ``spans`` in ``locations`` (all tiers by default) and wait for the writes."""
        objs = [
            await filled(self.pool, LAYOUT.payload_shape(CHUNK), LAYOUT.dtype, seed=seed + i)
            for i in range(len(spans))
        ]
        try:
            assert await self.manager.put(spans, objs, None, locations) == len(spans)
        finally:
            release(objs)
        assert await self.manager.flush(TIMEOUT)


def release(objs: Sequence[MemoryObj | None]) -> None:
    for obj in objs:
        if obj is not None:
            obj.unref()


@contextlib.asynccontextmanager
async def tiers(
    directory: Path | None,
    redis_url: str | None,
    *,
    disk_size: int = 1 << 26,
    disk_limits: TenantLimits | None = None,
    redis_limits: TenantLimits | None = None,
) -> AsyncIterator[Tiers]:
    pool = MemoryPool(16 << 20, page_size=PAGE, pin_memory=False)
    slow: list[Any] = []
    disk = redis = None
    if directory is not None:
        disk = await DiskBackend.open(
            directory,
            pool=pool,
            spec=SPEC,
            allocation_timeout=1,
            max_local_disk_size=disk_size,
            limits=disk_limits,
        )
        slow.append(disk)
    if redis_url is not None:
        redis = await RedisBackend.open(
            redis_url, pool=pool, spec=SPEC, allocation_timeout=1, limits=redis_limits
        )
        slow.append(redis)
    cpu = CPUBackend(pool)
    events = EventBuffer(1000)
    manager = StorageManager(cpu, events=events, chunk_size=CHUNK, pin_timeout=60, slow_tiers=slow)
    cpu.set_eviction_listener(manager.on_evicted)
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as task_group:
            await manager.start(task_group)
            yield Tiers(pool, manager, events, disk, redis)
            await manager.aclose()
    assert pool.stats().num_objects == 0, "a MemoryObj leaked"
    pool.close()


async def record_bytes(directory: Path) -> int:
    """The size of one record file of a full chunk."""
    async with tiers(directory, None) as t:
        await t.put(spans_of("a", 1), ["disk"])
        assert t.disk is not None
        return t.disk.stats().bytes


# -- disk ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_disk_over_its_capacity_reports_exactly_the_chunks_it_evicted(
    tmp_path: Path,
) -> None:
    size = await record_bytes(tmp_path / "sizing")
    old, new = spans_of("a", 3, seed=1), spans_of("a", 2, seed=2)
    async with tiers(tmp_path / "disk", None, disk_size=3 * size) as t:
        await t.put(old, ["disk"])
        t.events.take()
        await t.put(new, ["disk"])
        assert removed(t.events.take()) == [("disk", digests(old[:2]))]
        assert t.disk is not None and t.disk.stats().evictions == 2


@pytest.mark.anyio
async def test_a_disk_quota_eviction_reports_the_tenants_oldest_chunk(tmp_path: Path) -> None:
    size = await record_bytes(tmp_path / "sizing")
    a, b = spans_of("a", 3, seed=1), spans_of("b", 3, seed=2)
    quotas = limits(a=2 * size)
    async with tiers(tmp_path / "disk", None, disk_limits=quotas) as t:
        await t.put(b, ["disk"])
        await t.put(a[:2], ["disk"])
        t.events.take()
        await t.put(a[2:], ["disk"], seed=2)
        assert removed(t.events.take()) == [("disk", digests(a[:1]))]


@pytest.mark.anyio
async def test_a_corrupt_disk_record_deleted_on_a_read_is_reported(tmp_path: Path) -> None:
    spans = spans_of("a", 2)
    async with tiers(tmp_path / "disk", None) as t:
        await t.put(spans, ["disk"])
        assert t.disk is not None
        path = t.disk.path_of(spans[1].key)
        data = bytearray(path.read_bytes())
        data[-7] ^= 0x20
        path.write_bytes(bytes(data))
        t.events.take()
        got = await t.manager.fetch_prefix([s.key for s in spans], ["disk"])
        assert len(got) == 1
        release(got)
        assert not path.exists()
        assert removed(t.events.take()) == [("disk", digests(spans[1:]))]


# -- redis --------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_redis_quota_eviction_reports_the_evicted_chunk(
    redis_server: RedisServer,
) -> None:
    a = spans_of("a", 3)
    async with tiers(None, redis_server.url, redis_limits=limits(a=2 * PAYLOAD + HEADROOM)) as t:
        await t.put(a[:2], ["redis"])
        t.events.take()
        await t.put(a[2:], ["redis"], seed=2)
        assert removed(t.events.take()) == [("redis", digests(a[:1]))]
        assert t.redis is not None
        assert await t.redis.contains_prefix([a[0].key]) == 0
        assert await t.redis.contains_prefix([a[1].key, a[2].key]) == 2


@pytest.mark.anyio
async def test_a_write_that_evicts_its_own_chunk_has_it_removed_after_its_stored_event(
    redis_server: RedisServer,
) -> None:
    a = spans_of("a", 3)
    async with tiers(None, redis_server.url, redis_limits=limits(a=2 * PAYLOAD + HEADROOM)) as t:
        await t.put(a, ["redis"])
        events = [(e.kind, e.medium, list(e.block_hashes)) for e in t.events.take()]
        assert [(kind, medium) for kind, medium, _ in events] == [
            (EventKind.STORED, "redis"),
            (EventKind.REMOVED, "redis"),
        ]
        (gone,) = events[1][2]
        assert gone in digests(a)
        assert t.redis is not None
        lost = next(span.key for span in a if span.key.digest == gone)
        assert await t.redis.contains_prefix([lost]) == 0


@pytest.mark.anyio
async def test_a_corrupt_redis_record_deleted_on_a_read_is_reported(
    redis_server: RedisServer,
) -> None:
    spans = spans_of("a", 2)
    raw: Any = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        async with tiers(None, redis_server.url) as t:
            await t.put(spans, ["redis"])
            await raw.set(rkey(spans[1].key), b"not a record")
            t.events.take()
            got = await t.manager.fetch_prefix([s.key for s in spans], ["redis"])
            assert len(got) == 1
            release(got)
            assert await raw.exists(rkey(spans[1].key)) == 0
            assert removed(t.events.take()) == [("redis", digests(spans[1:]))]
    finally:
        await raw.aclose()


# -- the manager's calls over both slow tiers ---------------------------------------------


@pytest.mark.anyio
async def test_an_erasure_reports_exactly_the_tenants_chunks_in_every_tier(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    a, b = spans_of("a", 3, seed=1), spans_of("b", 2, seed=2)
    async with tiers(tmp_path, redis_server.url) as t:
        await t.put(a)
        await t.put(b, seed=3)
        t.events.take()
        assert await t.manager.erase_tenant(tenant_tag("a"), timeout=TIMEOUT) == {
            "cpu": 3,
            "disk": 3,
            "redis": 3,
        }
        gone = removed(t.events.take())
        assert sorted(medium for medium, _ in gone) == ["cpu", "disk", "redis"]
        for medium, hashes in gone:
            assert sorted(hashes) == sorted(digests(a)), medium


@pytest.mark.anyio
@pytest.mark.parametrize("location", ["disk", "redis"])
async def test_a_clear_of_one_slow_tier_reports_its_keys(
    tmp_path: Path, redis_server: RedisServer, location: str
) -> None:
    spans = spans_of("a", 3)
    async with tiers(tmp_path, redis_server.url) as t:
        await t.put(spans)
        t.events.take()
        assert await t.manager.clear([location]) == 3
        gone = removed(t.events.take())
        assert [medium for medium, _ in gone] == [location]
        assert sorted(gone[0][1]) == sorted(digests(spans))


@pytest.mark.anyio
async def test_a_clear_of_every_tier_is_one_cleared_event_and_no_removal(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with tiers(tmp_path, redis_server.url) as t:
        await t.put(spans_of("a", 3))
        t.events.take()
        assert await t.manager.clear() == 9
        assert [e.kind for e in t.events.take()] == [EventKind.CLEARED]


@pytest.mark.anyio
async def test_an_explicit_remove_is_recorded_once_per_tier_with_the_keys_it_held(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    spans, never = spans_of("a", 3), spans_of("b", 1)
    async with tiers(tmp_path, redis_server.url) as t:
        await t.put(spans)
        t.events.take()
        keys = [spans[0].key, spans[1].key, never[0].key]
        assert await t.manager.remove(keys) == 6
        gone = removed(t.events.take())
        assert sorted(medium for medium, _ in gone) == ["cpu", "disk", "redis"]
        for medium, hashes in gone:
            assert sorted(hashes) == sorted(digests(spans[:2])), medium


# -- what is recorded of what the tiers report --------------------------------------------


def recorder() -> tuple[RemovalEvents, EventBuffer]:
    buffer = EventBuffer(100)
    return RemovalEvents(TierEvents(buffer, chunk_size=CHUNK)), buffer


def test_the_probes_chunks_are_never_announced() -> None:
    events, buffer = recorder()
    real = spans_of("a", 1)[0].key
    probe = ChunkKey(PROBE_TAG + bytes(range(16)))
    events.record("redis", [probe, real])
    events.record("redis", [probe])
    assert removed(buffer.take()) == [("redis", [real.digest])]


def test_a_rewrite_records_only_the_keys_not_written_back() -> None:
    events, buffer = recorder()
    keys = [span.key for span in spans_of("a", 3)]
    with events.rewriting("disk", keys[:2]) as back:
        events.record("disk", keys)
        events.record("redis", keys[:1])
        assert removed(buffer.take()) == [("disk", [keys[2].digest]), ("redis", [keys[0].digest])]
        back.append(keys[0])
    assert removed(buffer.take()) == [("disk", [keys[1].digest])]


def test_nothing_is_recorded_while_every_tier_is_cleared() -> None:
    events, buffer = recorder()
    key = spans_of("a", 1)[0].key
    with events.clearing_all():
        events.record("disk", [key])
    assert buffer.take() == []
    events.record("disk", [key])
    assert removed(buffer.take()) == [("disk", [key.digest])]
