"""StorageManager.erase_tenant over the CPU tier and controllable slow tiers: every tier
is erased and only the tenant's chunks go; a tier that is down is reported, not skipped;
writes queued before the erasure never land after it, whether still queued, under way, or
still under way when the erasure stops waiting for them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import anyio
import pytest

from lmcache_async.backends.cpu import CPUBackend
from lmcache_async.backends.manager import StorageManager
from lmcache_async.errors import EraseIncompleteError, InvalidInputError
from lmcache_async.events import EventBuffer, EventKind
from lmcache_async.keys.chunks import ChunkHasher, ChunkKey, ChunkSpan, Namespace
from lmcache_async.memory.pool import MemoryObj, MemoryPool
from lmcache_async.tenancy.tenants import TAG_BYTES, tenant_tag
from tests.backends.test_manager import TIMEOUT, FakeTier, named_tier, payloads

A, B = tenant_tag("a"), tenant_tag("b")


def tenant_spans(tenant: str, n_chunks: int) -> list[ChunkSpan]:
    namespace = Namespace(model_name="m", layout_fingerprint="fp", tenant_salt=tenant)
    hasher = ChunkHasher(namespace, chunk_size=4)
    return hasher.spans(list(range(4 * n_chunks)))


def tags(keys: Iterable[bytes]) -> set[bytes]:
    return {bytes(key[:TAG_BYTES]) for key in keys}


def two_tier_manager(
    pool: MemoryPool, **kw: object
) -> tuple[StorageManager, CPUBackend, FakeTier, FakeTier, EventBuffer]:
    cpu = CPUBackend(pool)
    events = EventBuffer(100)
    disk, redis = named_tier(pool, "disk"), named_tier(pool, "redis")
    manager = StorageManager(
        cpu,
        events=events,
        chunk_size=4,
        pin_timeout=60,
        slow_tiers=[disk, redis],
        **kw,  # type: ignore[arg-type]
    )
    cpu.set_eviction_listener(manager.on_evicted)
    return manager, cpu, disk, redis, events


def release(objs: list[MemoryObj]) -> None:
    for obj in objs:
        obj.unref()


@pytest.mark.anyio
async def test_erasure_removes_the_tenant_from_every_tier_and_nothing_else() -> None:
    pool = MemoryPool(1 << 22)
    manager, cpu, disk, redis, events = two_tier_manager(pool, wait_for_slow_tiers=True)
    a, b = tenant_spans("a", 3), tenant_spans("b", 2)
    objs = payloads(pool, 5)
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await manager.start(tg)
            assert await manager.put(a, objs[:3], None) == 3
            assert await manager.put(b, objs[3:], None) == 2
            events.take()
            removed = await manager.erase_tenant(A, timeout=TIMEOUT)
            assert removed == {"cpu": 3, "disk": 3, "redis": 3}
            assert tags(disk.data) == tags(redis.data) == {B}
            assert len(disk.data) == len(redis.data) == len(cpu) == 2
            assert manager.contains_prefix([s.key for s in a]) == 0
            assert manager.contains_prefix([s.key for s in b]) == 2
            gone = events.take()
            assert [(e.kind, e.medium) for e in gone] == [(EventKind.REMOVED, "cpu")]
            assert tags(gone[0].block_hashes) == {A}
            # Again: nothing left of the tenant, nothing removed.
            assert await manager.erase_tenant(A, timeout=TIMEOUT) == {
                "cpu": 0,
                "disk": 0,
                "redis": 0,
            }
            for bad in (b"abc", A + b"x", "abcd"):
                with pytest.raises(InvalidInputError):
                    await manager.erase_tenant(bad, timeout=TIMEOUT)  # type: ignore[arg-type]
            release(objs)
            await manager.aclose()
    assert pool.stats().used_bytes == 0


@pytest.mark.anyio
async def test_a_tier_that_is_down_is_asked_and_its_failure_reported() -> None:
    pool = MemoryPool(1 << 22)
    manager, cpu, disk, redis, _ = two_tier_manager(pool, wait_for_slow_tiers=True)
    a = tenant_spans("a", 2)
    objs = payloads(pool, 2)
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await manager.start(tg)
            assert await manager.put(a, objs, None) == 2
            redis.up = False
            with pytest.raises(EraseIncompleteError) as caught:
                await manager.erase_tenant(A, timeout=TIMEOUT)
            assert caught.value.removed == {"cpu": 2, "disk": 2}
            assert list(caught.value.failed) == ["redis"]
            assert "down" in caught.value.failed["redis"]
            assert "redis" in str(caught.value)
            assert tags(redis.data) == {A}, "the down tier still holds it: hence the error"
            redis.up = True
            assert await manager.erase_tenant(A, timeout=TIMEOUT) == {
                "cpu": 0,
                "disk": 0,
                "redis": 2,
            }
            assert not redis.data and not disk.data and len(cpu) == 0
            release(objs)
            await manager.aclose()
    assert pool.stats().used_bytes == 0


@pytest.mark.anyio
async def test_a_tier_that_cannot_erase_is_reported() -> None:
    pool = MemoryPool(1 << 22)
    manager, _, _, redis, _ = two_tier_manager(pool)

    async def cannot(tag: bytes) -> int:
        raise NotImplementedError("the redis tier cannot erase a tenant")

    redis.erase_tenant = cannot  # type: ignore[method-assign]
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(EraseIncompleteError) as caught:
            await manager.erase_tenant(A, timeout=TIMEOUT)
    assert caught.value.removed == {"cpu": 0, "disk": 0}
    assert caught.value.failed == {"redis": "the redis tier cannot erase a tenant"}
    await manager.aclose()


@pytest.mark.anyio
async def test_queued_writes_of_the_tenant_are_dropped_and_one_under_way_is_awaited() -> None:
    """One write of A under way (held at the tier), then A, B and a mixed batch queued: the
    erasure drops A's queued chunks at once, waits for the write under way, erases after
    it; only B's chunks land, and every reference comes back."""
    pool = MemoryPool(1 << 22)
    manager, _, disk, redis, _ = two_tier_manager(pool, hot_cache=False)
    disk.gate = anyio.Event()
    redis.gate = anyio.Event()
    a, b = tenant_spans("a", 4), tenant_spans("b", 2)
    objs = payloads(pool, 6)
    mixed = [a[3], b[1]]
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await manager.start(tg)
            await manager.put(a[:2], objs[:2], None)
            await anyio.wait_all_tasks_blocked()  # each writer holds that batch at its gate
            await manager.put(a[2:3], objs[2:3], None)
            await manager.put(b[:1], objs[4:5], None)
            await manager.put(mixed, [objs[3], objs[5]], None)
            release(objs)  # the queued writes hold their own references
            result: dict[str, int] = {}

            async def erase() -> None:
                result.update(await manager.erase_tenant(A, timeout=TIMEOUT))

            tg.start_soon(erase)
            await anyio.wait_all_tasks_blocked()
            assert not result, "the erasure waits for the writes under way"
            disk.gate.set()
            redis.gate.set()
            assert await manager.flush(TIMEOUT)
            with anyio.fail_after(TIMEOUT):
                while not result:
                    await anyio.wait_all_tasks_blocked()
            assert result == {"cpu": 0, "disk": 2, "redis": 2}
            for tier in (disk, redis):
                assert tags(tier.data) == {B} and len(tier.data) == 2
            await manager.aclose()
    assert pool.stats().used_bytes == 0


@pytest.mark.anyio
async def test_a_write_still_under_way_when_the_wait_ends_removes_what_it_put() -> None:
    pool = MemoryPool(1 << 22)
    manager, _, disk, _, _ = two_tier_manager(pool, hot_cache=False)
    disk.gate = anyio.Event()
    a = tenant_spans("a", 2)
    objs = payloads(pool, 2)
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await manager.start(tg)
            await manager.put(a, objs, None)
            await anyio.wait_all_tasks_blocked()
            release(objs)
            with pytest.raises(EraseIncompleteError) as caught:
                await manager.erase_tenant(A, timeout=0.01)
            assert list(caught.value.failed) == ["disk"]
            assert "under way" in caught.value.failed["disk"]
            assert caught.value.removed == {"cpu": 0, "disk": 0, "redis": 2}
            disk.gate.set()  # the write lands now, after the erasure...
            assert await manager.flush(TIMEOUT)
            assert disk.data == {}, "...and removes what it put"
            assert disk.puts == 1
            assert manager.tier_writes_failed == 0
            await manager.aclose()
    assert pool.stats().used_bytes == 0


@pytest.mark.anyio
async def test_writes_after_the_erasure_land() -> None:
    pool = MemoryPool(1 << 22)
    manager, _, disk, _, _ = two_tier_manager(pool, hot_cache=False)
    disk.gate = anyio.Event()
    a = tenant_spans("a", 2)
    objs = payloads(pool, 2)
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await manager.start(tg)
            await manager.put(a[:1], objs[:1], None)
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(EraseIncompleteError):
                await manager.erase_tenant(A, timeout=0.01)
            await manager.put(a[1:], objs[1:], None)  # stored after the erasure: kept
            disk.gate.set()
            assert await manager.flush(TIMEOUT)
            assert set(disk.data) == {bytes(a[1].key)}
            release(objs)
            await manager.aclose()
    assert pool.stats().used_bytes == 0


@pytest.mark.anyio
async def test_a_store_half_way_through_its_tier_writes_writes_nothing_after_the_erasure() -> None:
    """A store that waits for the slow tiers is held at the disk; the erasure stops waiting
    for it and returns. When the disk write ends it removes what it put, and the store's
    next write (Redis), begun after the erasure with payloads from before it, is dropped."""
    pool = MemoryPool(1 << 22)
    manager, cpu, disk, redis, _ = two_tier_manager(pool, wait_for_slow_tiers=True)
    disk.gate = anyio.Event()
    a = tenant_spans("a", 2)
    objs = payloads(pool, 2)
    stored = anyio.Event()
    kept: list[int] = []

    async def store() -> None:
        kept.append(await manager.put(a, objs, None))
        stored.set()

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await manager.start(tg)
            tg.start_soon(store)
            await anyio.wait_all_tasks_blocked()  # the disk write is held at its gate
            assert len(cpu) == 2 and not redis.data
            with pytest.raises(EraseIncompleteError) as caught:
                await manager.erase_tenant(A, timeout=0.01)
            assert caught.value.removed == {"cpu": 2, "disk": 0, "redis": 0}
            disk.gate.set()
            await stored.wait()
            assert disk.data == {} and redis.data == {}, "nothing of a lands after the erasure"
            assert redis.puts == 0
            assert len(cpu) == 0
            release(objs)
            await manager.aclose()
    assert pool.stats().used_bytes == 0


@pytest.mark.anyio
async def test_a_slow_read_in_flight_is_returned_but_never_promoted_after_the_erasure() -> None:
    pool = MemoryPool(1 << 22)
    manager, cpu, disk, _, _ = two_tier_manager(pool)
    a = tenant_spans("a", 2)
    objs = payloads(pool, 2)
    for span, obj in zip(a, objs, strict=True):
        disk.data[bytes(span.key)] = obj.tensor.clone()
    release(objs)
    read, go = anyio.Event(), anyio.Event()
    get = disk.get

    async def held_get(keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        got = await get(keys)  # the bytes are read...
        read.set()
        await go.wait()  # ...and returned only after the erasure
        return got

    disk.get = held_get  # type: ignore[method-assign]
    fetched: list[MemoryObj] = []

    async def fetch() -> None:
        fetched.extend(await manager.fetch_prefix([span.key for span in a]))

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(fetch)
            await read.wait()
            assert await manager.erase_tenant(A, timeout=TIMEOUT) == {
                "cpu": 0,
                "disk": 2,
                "redis": 0,
            }
            go.set()
        assert len(fetched) == 2, "the read began before the erasure: its caller gets it"
        release(fetched)
        assert len(cpu) == 0 and manager.promoted_chunks == 0
        assert await manager.lookup_prefix([span.key for span in a]) == 0
        await manager.aclose()
    assert pool.stats().used_bytes == 0
