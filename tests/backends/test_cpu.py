"""The CPU tier: LRU order, references, pins and eviction on memory pressure."""

from __future__ import annotations

import anyio
import pytest
import torch

from lmcache_async.backends.cpu import CPUBackend
from lmcache_async.keys.chunks import DIGEST_SIZE, LINK_SIZE, ChunkKey
from lmcache_async.memory.pool import MemoryPool
from lmcache_async.stats import TenantUsage
from lmcache_async.tenancy.tenants import tag_hex, tenant_tag

PAGE = 64 * 1024


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(DIGEST_SIZE, "little"))


def filled(pool: MemoryPool, value: int) -> object:
    obj = pool.allocate_nowait((PAGE,), torch.uint8)
    assert obj is not None
    obj.tensor.fill_(value)
    return obj


def make(pages: int = 4) -> tuple[MemoryPool, CPUBackend, list[list[ChunkKey]]]:
    pool = MemoryPool(pages * PAGE, page_size=PAGE, pin_memory=False)
    evicted: list[list[ChunkKey]] = []
    cpu = CPUBackend(pool, on_evict=evicted.append)
    return pool, cpu, evicted


def put(cpu: CPUBackend, pool: MemoryPool, i: int) -> None:
    obj = pool.allocate_nowait((PAGE,), torch.uint8)
    assert obj is not None
    obj.tensor.fill_(i)
    assert cpu.put_nowait([key(i)], [obj]) == 1
    obj.unref()  # the tier holds its own reference


def test_prefix_and_get_return_referenced_payloads() -> None:
    pool, cpu, _ = make()
    for i in range(3):
        put(cpu, pool, i)
    assert cpu.contains_prefix_nowait([key(0), key(1), key(9), key(2)]) == 2
    objs = cpu.get_prefix_nowait([key(0), key(1), key(2), key(3)])
    assert [int(o.tensor[0]) for o in objs] == [0, 1, 2]
    assert all(o.ref_count == 2 for o in objs)
    for o in objs:
        o.unref()
    assert cpu.clear_nowait() == [key(0), key(1), key(2)]
    assert pool.stats().used_bytes == 0


@pytest.mark.anyio
async def test_get_prefix_is_the_leading_run() -> None:
    pool, cpu, _ = make()
    for i in (0, 1, 3):
        put(cpu, pool, i)
    objs = await cpu.get_prefix([key(0), key(1), key(2), key(3)])
    assert [int(o.tensor[0]) for o in objs] == [0, 1]
    assert all(o.ref_count == 2 for o in objs)
    for o in objs:
        o.unref()
    await cpu.aclose()
    assert pool.stats().used_bytes == 0


def test_eviction_drops_least_recently_used_unreferenced_unpinned() -> None:
    pool, cpu, evicted = make(pages=3)
    for i in range(3):
        put(cpu, pool, i)
    cpu.contains_prefix_nowait([key(0)])  # 0 becomes most recent; 1 is now the oldest
    pinned = cpu.pin_prefix_nowait([key(1)])
    held = cpu.get_prefix_nowait([key(2)])
    # 1 is pinned and 2 is referenced by a reader: only 0 can go.
    assert pool.allocate_nowait((PAGE,), torch.uint8) is not None
    assert evicted == [[key(0)]]
    assert key(0) not in cpu and key(1) in cpu and key(2) in cpu
    assert pool.allocate_nowait((PAGE,), torch.uint8) is None
    for obj in pinned:
        obj.unpin()
        obj.unref()
    for obj in held:
        obj.unref()


def test_existing_key_keeps_its_payload() -> None:
    pool, cpu, _ = make()
    put(cpu, pool, 5)
    other = pool.allocate_nowait((PAGE,), torch.uint8)
    assert other is not None
    other.tensor.fill_(99)
    assert cpu.put_nowait([key(5)], [other]) == 0
    other.unref()
    (obj,) = cpu.get_prefix_nowait([key(5)])
    assert int(obj.tensor[0]) == 5
    obj.unref()


@pytest.mark.anyio
async def test_pool_waiter_is_served_by_eviction() -> None:
    pool, cpu, _ = make(pages=2)
    put(cpu, pool, 0)
    put(cpu, pool, 1)
    with anyio.fail_after(5):
        obj = await pool.allocate((2 * PAGE,), torch.uint8, timeout=1)
    assert len(cpu) == 0
    obj.unref()
    assert cpu.stats().evictions == 2
    await cpu.aclose()
    assert pool.stats().used_bytes == 0


def test_usage_is_accounted_by_tenant_without_quotas() -> None:
    pool, cpu, evicted = make(pages=4)
    a, b = tenant_tag("a"), tenant_tag("b")
    keys = [ChunkKey(a + i.to_bytes(LINK_SIZE, "little")) for i in range(4)]
    other = ChunkKey(b + bytes(LINK_SIZE))
    for k in [*keys, other]:  # the pool is full at the last one: evicts the oldest
        obj = pool.allocate_nowait((PAGE,), torch.uint8)
        assert obj is not None
        assert cpu.put_nowait([k], [obj]) == 1
        obj.unref()
    assert evicted == [[keys[0]]]
    assert cpu.remove_nowait([keys[1]]) == 1
    assert cpu.stats().tenants == {
        tag_hex(a): TenantUsage(chunks=2, bytes=2 * PAGE, evictions=1),
        tag_hex(b): TenantUsage(chunks=1, bytes=PAGE),
    }
    assert sorted(cpu.erase_tenant_nowait(a)) == sorted(keys[2:])
    assert pool.stats().used_bytes == PAGE
    assert cpu.stats().tenants[tag_hex(a)] == TenantUsage(erased=2, evictions=1)
    cpu.clear_nowait()
    assert cpu.stats().tenants[tag_hex(b)] == TenantUsage()
    assert pool.stats().used_bytes == 0


def test_without_quotas_the_tier_keeps_one_map_of_its_keys() -> None:
    """Each cached chunk costs the tier one index entry: without quotas the ledger only
    counts, and eviction walks the tier's own LRU order."""
    pool, cpu, evicted = make(pages=2)
    put(cpu, pool, 0)
    put(cpu, pool, 1)
    assert all(not account.keys for account in cpu.ledger._accounts.values())
    cpu.contains_prefix_nowait([key(0)])  # 1 is now the oldest
    put(cpu, pool, 2)
    assert evicted == [[key(1)]]
    usage = cpu.stats().tenants.values()  # these keys' first bytes make a tenant each
    assert sum(u.chunks for u in usage) == 2 and sum(u.bytes for u in usage) == 2 * PAGE
    assert sum(u.evictions for u in usage) == 1


@pytest.mark.anyio
async def test_the_pool_is_empty_again_after_clear_and_after_close() -> None:
    pool, cpu, _ = make(pages=4)
    for i in range(3):
        put(cpu, pool, i)
    short = pool.allocate_nowait((100,), torch.uint8)  # a short chunk: one whole page
    assert short is not None
    assert cpu.put_nowait([key(9)], [short]) == 1
    short.unref()
    assert pool.stats().used_bytes == 4 * PAGE
    cpu.clear_nowait()
    assert (pool.stats().used_bytes, pool.stats().num_objects) == (0, 0)
    for i in range(2):
        put(cpu, pool, i)
    held = cpu.get_prefix_nowait([key(0)])
    await cpu.aclose()
    assert pool.stats().num_objects == 1  # the reader's reference keeps its payload
    held[0].unref()
    assert (pool.stats().used_bytes, pool.stats().num_objects) == (0, 0)
    assert cpu.stats().bytes == 0
