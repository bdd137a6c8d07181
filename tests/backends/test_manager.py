"""StorageManager with a controllable slow tier: write-behind queue bounds, a tier that is
down, failing calls as misses, promotion, and the health monitor bringing a tier back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from lmcache_async.backends.base import StorageBackend
from lmcache_async.backends.cpu import CPUBackend
from lmcache_async.backends.manager import StorageManager
from lmcache_async.errors import TierUnavailableError
from lmcache_async.events import EventBuffer, EventKind
from lmcache_async.health import HealthMonitor
from lmcache_async.keys import ChunkHasher, ChunkKey, Namespace
from lmcache_async.memory import MemoryObj, MemoryPool
from lmcache_async.stats import TierStats

TIMEOUT = 10


class FakeTier(StorageBackend):
    """An in-memory slow tier whose puts can be held back and whose calls can fail."""

    name = "disk"

    def __init__(self, pool: MemoryPool) -> None:
        self.pool = pool
        self.data: dict[bytes, torch.Tensor] = {}
        self.gate = anyio.Event()
        self.gate.set()
        self.up = True
        self.probe_ok = True
        self.puts = 0

    def _check(self) -> None:
        if not self.up:
            raise TierUnavailableError("fake tier is down")

    async def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        self._check()
        n = 0
        for key in keys:
            if bytes(key) not in self.data:
                break
            n += 1
        return n

    async def get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
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
