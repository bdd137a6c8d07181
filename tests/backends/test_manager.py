"""StorageManager with controllable slow tiers: write-behind queue bounds, a tier that is
down, failing calls as misses, promotion, the health monitor bringing a tier back, one
event per put built once, lookups that start from the CPU tier's count, and fetches
without a lookup over a prefix split across the CPU, disk and Redis tiers (fakes, then
the real tiers on a redis-server)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from lmcache_async.backends.base import StorageBackend
from lmcache_async.backends.cpu import CPUBackend
from lmcache_async.backends.disk import DiskBackend
from lmcache_async.backends.manager import StorageManager
from lmcache_async.backends.redis import RedisBackend
from lmcache_async.errors import InvalidInputError, TierUnavailableError
from lmcache_async.events import EventBuffer, EventKind
from lmcache_async.health import HealthMonitor
from lmcache_async.keys.chunks import ChunkHasher, ChunkKey, Namespace
from lmcache_async.memory.pool import MemoryObj, MemoryPool
from lmcache_async.stats import TierStats
from tests.backends.test_redis import (
    CHUNK,
    PAGE,
    command_calls,
    filled,
    make_layout,
    make_spec,
    raw_bytes,
)
from tests.backends.test_redis import key as redis_key
from tests.servers import RedisServer

TIMEOUT = 10


class FakeTier(StorageBackend):
    """An in-memory slow tier whose puts can be held back and whose calls can fail; it
    records the keys each lookup and read asked it about."""

    name = "disk"

    def __init__(self, pool: MemoryPool) -> None:
        self.pool = pool
        self.data: dict[bytes, torch.Tensor] = {}
        self.gate = anyio.Event()
        self.gate.set()
        self.up = True
        self.probe_ok = True
        self.puts = 0
        self.erased = 0
        self.contains_calls: list[list[ChunkKey]] = []
        self.get_calls: list[list[ChunkKey]] = []

    def _check(self) -> None:
        if not self.up:
            raise TierUnavailableError("fake tier is down")

    async def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        self.contains_calls.append(list(keys))
        self._check()
        n = 0
        for key in keys:
            if bytes(key) not in self.data:
                break
            n += 1
        return n

    async def get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        self.get_calls.append(list(keys))
        self._check()
        out: list[MemoryObj | None] = []
        for key in keys:
            tensor = self.data.get(bytes(key))
            if tensor is None:
                out.append(None)
                continue
            obj = await self.pool.allocate(tuple(tensor.shape), tensor.dtype, timeout=1)
            obj.tensor.copy_(tensor)
            out.append(obj)
        return out

    async def put(
        self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj], *, spec: object = None
    ) -> int:
        await self.gate.wait()
        self._check()
        for key, obj in zip(keys, objs, strict=True):
            self.data[bytes(key)] = obj.tensor.clone()
        self.puts += 1
        return len(keys)

    async def remove(self, keys: Sequence[ChunkKey]) -> int:
        return sum(self.data.pop(bytes(k), None) is not None for k in keys)

    async def clear(self) -> int:
        n = len(self.data)
        self.data.clear()
        return n

    async def erase_tenant(self, tag: bytes) -> int:
        self._check()
        keys = [key for key in self.data if key[: len(tag)] == tag]
        for key in keys:
            del self.data[key]
        self.erased += len(keys)
        return len(keys)

    def healthy(self) -> bool:
        return self.up

    async def check_health(self) -> bool:
        self.up = self.probe_ok
        return self.up

    def stats(self) -> TierStats:
        return TierStats(self.name, len(self.data), 0, 0, 0, self.puts, 0, self.up)

    async def aclose(self) -> None:
        self.data.clear()


def spans(n_chunks: int, seed: int = 0) -> list:  # type: ignore[type-arg]
    hasher = ChunkHasher(Namespace(model_name="m", layout_fingerprint="fp"), chunk_size=4)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1000, (4 * n_chunks,), generator=gen).tolist()
    return hasher.spans(tokens)


def payloads(pool: MemoryPool, n: int, seed: int = 0) -> list[MemoryObj]:
    gen = torch.Generator().manual_seed(seed)
    objs = []
    for _ in range(n):
        obj = pool.allocate_nowait((2, 1, 4, 8), torch.float16)
        assert obj is not None
        obj.tensor.copy_(torch.randn(2, 1, 4, 8, generator=gen))
        objs.append(obj)
    return objs


def make(pool: MemoryPool, tier: FakeTier, **kw: object) -> StorageManager:
    cpu = CPUBackend(pool)
    return StorageManager(
        cpu,
        events=EventBuffer(100),
        chunk_size=4,
        pin_timeout=60,
        slow_tiers=[tier],
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.anyio
async def test_full_write_queue_skips_the_slow_tier_and_counts_it() -> None:
    pool = MemoryPool(1 << 22)
    tier = FakeTier(pool)
    tier.gate = anyio.Event()  # hold writes back
    manager = make(pool, tier, write_queue_size=1)
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await manager.start(tg)
            objs = payloads(pool, 4)
            sp = spans(4)
            # The writer takes the first batch and blocks on the gate; the second fills
            # the queue; the third and fourth are skipped.
            for i in range(4):
                assert await manager.put(sp[i : i + 1], objs[i : i + 1], None) == 1
                await anyio.wait_all_tasks_blocked()
            assert manager.tier_writes_dropped == 2
            assert manager.tier_writes_pending == 2
            tier.gate.set()
            assert await manager.flush(TIMEOUT)
            assert set(tier.data) == {bytes(s.key) for s in sp[:2]}
            for obj in objs:
                obj.unref()
            await manager.aclose()
    assert pool.stats().used_bytes == 0


@pytest.mark.anyio
async def test_a_tier_that_is_down_is_bypassed_and_comes_back() -> None:
    pool = MemoryPool(1 << 22)
    tier = FakeTier(pool)
    manager = make(pool, tier)
    monitor = HealthMonitor([tier], interval=0.01, timeout=1)
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await manager.start(tg)
            sp = spans(3)
            objs = payloads(pool, 3)
            await manager.put(sp, objs, None, ["disk"])
            assert await manager.flush(TIMEOUT)
            keys = [s.key for s in sp]
            assert await manager.lookup_prefix(keys) == 3
            tier.up = False
            tier.probe_ok = False
            assert await manager.lookup_prefix(keys) == 0  # skipped, not raised
            assert await manager.fetch_prefix(keys) == []
            assert await manager.put(sp, objs, None, ["disk"]) == 0
            assert await monitor.check_once() == {"disk": False}
            tier.probe_ok = True
            assert await monitor.check_once() == {"disk": True}
            got = await manager.fetch_prefix(keys)
            assert [
                bool(torch.equal(g.tensor, o.tensor)) for g, o in zip(got, objs, strict=True)
            ] == [True] * 3
            assert manager.promoted_chunks == 3
            for obj in got + objs:
                obj.unref()
            await manager.aclose()
    assert pool.stats().used_bytes == 0


@pytest.mark.anyio
async def test_a_failing_call_is_a_miss_and_counted() -> None:
    pool = MemoryPool(1 << 22)
    tier = FakeTier(pool)
    manager = make(pool, tier)
    sp = spans(2)
    tier.data = {bytes(s.key): torch.zeros(2, 1, 4, 8, dtype=torch.float16) for s in sp}

    async def boom(keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        raise TierUnavailableError("connection reset")

    tier.get = boom  # type: ignore[method-assign]
    with anyio.fail_after(TIMEOUT):
        assert await manager.fetch_prefix([s.key for s in sp]) == []
    assert manager.tier_read_errors == 1
    await manager.aclose()


class CountingTokens(np.ndarray):  # type: ignore[type-arg]
    """A token array that counts how often it is copied out to a list."""

    tolist_calls = 0

    def tolist(self) -> Any:
        type(self).tolist_calls += 1
        return super().tolist()


def named_tier(pool: MemoryPool, name: str) -> FakeTier:
    tier = FakeTier(pool)
    tier.name = name
    return tier


@pytest.mark.anyio
async def test_a_put_builds_its_event_once_and_every_tier_shares_it() -> None:
    """One put to three tiers: one event per tier, from one copy of the tokens."""
    pool = MemoryPool(1 << 22)
    events = EventBuffer(100)
    manager = StorageManager(
        CPUBackend(pool),
        events=events,
        chunk_size=4,
        pin_timeout=60,
        slow_tiers=[named_tier(pool, "disk"), named_tier(pool, "redis")],
        wait_for_slow_tiers=True,
    )
    sp = spans(3)
    tokens = np.arange(12, dtype=np.int64).view(CountingTokens)
    CountingTokens.tolist_calls = 0
    objs = payloads(pool, 3)
    with anyio.fail_after(TIMEOUT):
        assert await manager.put(sp, objs, tokens) == 3
    stored = events.take()
    assert [e.medium for e in stored] == ["cpu", "disk", "redis"]
    assert all(e.kind is EventKind.STORED for e in stored)
    assert all(e.token_ids == tuple(range(12)) for e in stored)
    assert all(e.block_hashes == tuple(s.key.digest for s in sp) for e in stored)
    assert CountingTokens.tolist_calls == 1
    assert len({id(e.token_ids) for e in stored}) == 1, "the tiers share one copy"
    for obj in objs:
        obj.unref()
    await manager.aclose()
    assert pool.stats().used_bytes == 0


@pytest.mark.anyio
async def test_no_event_is_built_while_events_are_off() -> None:
    pool = MemoryPool(1 << 22)
    manager = StorageManager(
        CPUBackend(pool),
        events=EventBuffer(100, enabled=False),
        chunk_size=4,
        pin_timeout=60,
        slow_tiers=[named_tier(pool, "disk")],
        wait_for_slow_tiers=True,
    )
    tokens = np.arange(8, dtype=np.int64).view(CountingTokens)
    CountingTokens.tolist_calls = 0
    objs = payloads(pool, 2)
    with anyio.fail_after(TIMEOUT):
        assert await manager.put(spans(2), objs, tokens) == 2
    assert CountingTokens.tolist_calls == 0
    for obj in objs:
        obj.unref()
    await manager.aclose()


def three_tiers(pool: MemoryPool) -> tuple[StorageManager, CPUBackend, FakeTier, FakeTier]:
    cpu = CPUBackend(pool)
    disk, redis = named_tier(pool, "disk"), named_tier(pool, "redis")
    manager = StorageManager(
        cpu, events=EventBuffer(100), chunk_size=4, pin_timeout=60, slow_tiers=[disk, redis]
    )
    return manager, cpu, disk, redis


def hold(tier: FakeTier, sp: list, objs: list[MemoryObj], ids: list[int]) -> None:  # type: ignore[type-arg]
    for i in ids:
        tier.data[bytes(sp[i].key)] = objs[i].tensor.clone()


@pytest.mark.anyio
async def test_a_lookup_given_the_cpu_count_does_not_walk_those_keys_again() -> None:
    pool = MemoryPool(1 << 22)
    manager, cpu, disk, _ = three_tiers(pool)
    sp = spans(6)
    keys = [s.key for s in sp]
    objs = payloads(pool, 6)
    cpu.put_nowait(keys[:2], objs[:2])
    hold(disk, sp, objs, [2, 3, 5])
    walked_from: list[int] = []
    walk = cpu.contains_prefix_nowait

    def counting(asked: Sequence[bytes]) -> int:
        walked_from.append(len(keys) - len(asked))
        return walk(asked)

    cpu.contains_prefix_nowait = counting  # type: ignore[method-assign]
    with anyio.fail_after(TIMEOUT):
        hits = manager.contains_prefix(keys)
        assert (hits, walked_from) == (2, [0])
        walked_from.clear()
        assert await manager.lookup_prefix(keys, cpu_hits=hits) == 4
        # The CPU tier is asked only where the disk tier left the run, and the disk tier
        # is not asked again where it stopped.
        assert walked_from == [4]
        assert [len(keys) - len(asked) for asked in disk.contains_calls] == [2]
        walked_from.clear()
        assert await manager.lookup_prefix(keys) == 4
        assert walked_from == [0, 4]
        walked_from.clear()
        assert await manager.lookup_prefix(keys[:2], cpu_hits=2) == 2
        assert walked_from == []
        for bad in (-1, 7, True, 2.0):
            with pytest.raises(InvalidInputError):
                await manager.lookup_prefix(keys, cpu_hits=bad)  # type: ignore[arg-type]
    for obj in objs:
        obj.unref()
    await manager.aclose()
    assert pool.stats().used_bytes == 0


@pytest.mark.anyio
async def test_a_fetch_without_a_lookup_reads_a_prefix_split_over_three_tiers() -> None:
    """CPU 0-1, disk 2-3, redis 4-5, nothing at 6 (7 on both, past the gap): the fetch
    returns 0-5 with no lookup call, asks each slow tier only from where the run stands and
    never again where it stopped itself, and promotes what they returned."""
    pool = MemoryPool(1 << 22)
    manager, cpu, disk, redis = three_tiers(pool)
    sp = spans(8)
    keys = [s.key for s in sp]
    objs = payloads(pool, 8)
    cpu.put_nowait(keys[:2], objs[:2])
    hold(disk, sp, objs, [2, 3, 7])
    hold(redis, sp, objs, [4, 5, 7])
    with anyio.fail_after(TIMEOUT):
        got = await manager.fetch_prefix(keys)
    try:
        assert [bool(torch.equal(g.tensor, o.tensor)) for g, o in zip(got, objs, strict=False)] == [
            True
        ] * 6
        assert len(got) == 6
    finally:
        for obj in got:
            obj.unref()
    assert disk.contains_calls == redis.contains_calls == []
    assert disk.get_calls == [keys[2:], keys[6:]]  # it might have held 6
    assert redis.get_calls == [keys[4:]]  # it stopped at 6 itself
    assert manager.promoted_chunks == 4
    assert manager.contains_prefix(keys) == 6
    with anyio.fail_after(TIMEOUT):
        again = await manager.fetch_prefix(keys[:6])
    assert len(again) == 6 and len(disk.get_calls) == 2, "served by the CPU tier alone"
    for obj in again + objs:
        obj.unref()
    await manager.aclose()
    assert pool.stats().used_bytes == 0


@pytest.mark.anyio
async def test_a_failing_tier_ends_its_part_of_a_fetch_not_the_fetch() -> None:
    pool = MemoryPool(1 << 22)
    manager, _, disk, redis = three_tiers(pool)
    sp = spans(4)
    keys = [s.key for s in sp]
    objs = payloads(pool, 4)
    hold(disk, sp, objs, [0, 1, 2, 3])
    hold(redis, sp, objs, [0, 1])

    async def boom(keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        raise TierUnavailableError("connection reset")

    disk.get = boom  # type: ignore[method-assign]
    with anyio.fail_after(TIMEOUT):
        got = await manager.fetch_prefix(keys)
    # Redis carries the run to 2; the disk tier, failed once, is not asked again there.
    assert len(got) == 2 and manager.tier_read_errors == 1
    for obj in got + objs:
        obj.unref()
    await manager.aclose()
    assert pool.stats().used_bytes == 0


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_a_fetch_over_cpu_disk_and_real_redis_sends_no_exists(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The same split over the real tiers: Redis sees GETs alone, once per key from where
    the run reached it; neither slow tier decodes the chunk past the gap."""
    layout = make_layout()
    spec = make_spec(layout)
    pool = MemoryPool(16 << 20, page_size=PAGE, pin_memory=False)
    disk = await DiskBackend.open(
        tmp_path, pool=pool, spec=spec, allocation_timeout=1, max_local_disk_size=1 << 26
    )
    remote = await RedisBackend.open(redis_server.url, pool=pool, spec=spec, allocation_timeout=1)
    cpu = CPUBackend(pool)
    manager = StorageManager(
        cpu, events=EventBuffer(100), chunk_size=CHUNK, pin_timeout=60, slow_tiers=[disk, remote]
    )
    keys = [redis_key(i) for i in range(8)]
    shape = layout.payload_shape(CHUNK)
    objs = [await filled(pool, shape, layout.dtype, seed=i) for i in range(8)]
    with anyio.fail_after(TIMEOUT):
        cpu.put_nowait(keys[:2], objs[:2])
        assert await disk.put([keys[i] for i in (2, 3, 7)], [objs[i] for i in (2, 3, 7)]) == 3
        assert await remote.put([keys[i] for i in (4, 5, 7)], [objs[i] for i in (4, 5, 7)]) == 3
        redis_server.command("CONFIG", "RESETSTAT")
        got = await manager.fetch_prefix(keys)
    try:
        assert len(got) == 6
        assert all(torch.equal(raw_bytes(g), raw_bytes(o)) for g, o in zip(got, objs, strict=False))
    finally:
        for obj in got + objs:
            obj.unref()
    assert command_calls(redis_server, "exists") == 0
    assert command_calls(redis_server, "get") == 4  # keys 4 to 7, in one batch
    assert (disk.stats().hits, remote.stats().hits) == (2, 2)
    assert manager.promoted_chunks == 4
    assert manager.tier_read_errors == 0
    await manager.aclose()
    assert pool.stats().num_objects == 0
