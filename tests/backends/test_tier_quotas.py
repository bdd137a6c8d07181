"""Tenant quotas, usage and erasure in the CPU and disk tiers: a tenant that writes far
past its quota evicts only its own chunks, a tenant within its quota is never evicted for
another, and erasing a tenant removes exactly its chunks (for disk, its files, and after a
restart too)."""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable, Iterator
from pathlib import Path
from types import MappingProxyType

import anyio
import anyio.from_thread
import pytest
import torch

from lmcache_async.backends import disk_file
from lmcache_async.backends.cpu import CPUBackend
from lmcache_async.backends.disk import CHUNK_SUFFIX, TEMP_PREFIX, DiskBackend
from lmcache_async.backends.pins import PinSets
from lmcache_async.backends.record import RecordSpec
from lmcache_async.keys.chunks import LINK_SIZE, ChunkKey
from lmcache_async.memory.pool import MemoryObj, MemoryPool
from lmcache_async.tenancy.quotas import TierQuota
from lmcache_async.tenancy.tenants import TenantLimits, tag_hex, tenant_tag
from tests.backends.test_disk import LAYOUT, make_spec

A = tenant_tag("a")
B = tenant_tag("b")
C = tenant_tag("c")  # no quota anywhere here

Encoded = list[tuple[bytes, bytes | memoryview]]

PAGE = 4096
SHAPE = LAYOUT.payload_shape(16)  # 2048 bytes of bfloat16, as in test_disk


def key(tag: bytes) -> ChunkKey:
    return ChunkKey(tag + os.urandom(LINK_SIZE))


def limits(**named: int) -> TenantLimits:
    return TenantLimits(TierQuota(MappingProxyType(named), None))


def payload(k: bytes, nbytes: int) -> torch.Tensor:
    """The bytes chunk ``k`` holds (random, from its key)."""
    generator = torch.Generator().manual_seed(int.from_bytes(k[-8:], "little"))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def raw(obj: MemoryObj) -> torch.Tensor:
    return obj.tensor.reshape(-1).view(torch.uint8)


def new_obj(pool: MemoryPool, k: bytes) -> MemoryObj:
    obj = pool.allocate_nowait(SHAPE, LAYOUT.dtype)
    assert obj is not None, "no room in the pool"
    raw(obj).copy_(payload(k, obj.nbytes))
    return obj


@pytest.fixture
def pool() -> Iterator[MemoryPool]:
    pool = MemoryPool(64 * PAGE, page_size=PAGE, pin_memory=False)
    yield pool
    assert pool.stats().num_objects == 0, "a MemoryObj leaked"
    pool.close()


# --------------------------------------------------------------------------- CPU tier


def cpu_put(cpu: CPUBackend, pool: MemoryPool, keys: list[ChunkKey]) -> int:
    added = 0
    for k in keys:
        obj = new_obj(pool, k)
        added += cpu.put_nowait([k], [obj])
        obj.unref()  # the tier holds its own reference
    return added


def cpu_check(cpu: CPUBackend, keys: list[ChunkKey]) -> None:
    """Every key is held with exactly its bytes."""
    got = cpu.get_nowait(keys)
    try:
        for k, obj in zip(keys, got, strict=True):
            assert obj is not None, f"chunk {k.to_str()} missing"
            assert torch.equal(raw(obj), payload(k, obj.nbytes))
    finally:
        for obj in got:
            if obj is not None:
                obj.unref()


def test_cpu_a_tenant_past_its_quota_evicts_only_its_own_chunks(pool: MemoryPool) -> None:
    chunk = PAGE // 2
    evicted: list[list[ChunkKey]] = []
    cpu = CPUBackend(pool, on_evict=evicted.append, limits=limits(a=4 * chunk, b=4 * chunk))
    b_keys = [key(B) for _ in range(4)]
    assert cpu_put(cpu, pool, b_keys) == 4
    a_keys = [key(A) for _ in range(40)]  # 10 times a's quota
    for k in a_keys:
        assert cpu_put(cpu, pool, [k]) == 1
        cpu_check(cpu, b_keys)  # b's chunks keep being hit: hits change nothing for a
    cpu_check(cpu, b_keys)
    cpu_check(cpu, a_keys[-4:])
    usage = cpu.stats().tenants
    assert usage[tag_hex(A)].bytes <= 4 * chunk
    assert (usage[tag_hex(A)].chunks, usage[tag_hex(A)].evictions) == (4, 36)
    assert (usage[tag_hex(B)].chunks, usage[tag_hex(B)].evictions) == (4, 0)
    assert usage[tag_hex(A)].quota_bytes == 4 * chunk
    assert [k for batch in evicted for k in batch] == a_keys[:36]
    assert cpu.stats().evictions == 36
    cpu.clear_nowait()


def test_cpu_hits_keep_a_tenants_lru_order(pool: MemoryPool) -> None:
    chunk = PAGE // 2
    cpu = CPUBackend(pool, limits=limits(a=3 * chunk))
    a_keys = [key(A) for _ in range(3)]
    cpu_put(cpu, pool, a_keys)
    assert cpu.contains_prefix_nowait([a_keys[0]]) == 1  # 0 is a's newest now
    for obj in cpu.get_prefix_nowait([a_keys[1]]):  # then 1
        obj.unref()
    newer = key(A)
    cpu_put(cpu, pool, [newer])
    assert a_keys[2] not in cpu, "the least recently used of a's chunks went"
    cpu_check(cpu, [a_keys[0], a_keys[1], newer])
    cpu.clear_nowait()


def test_cpu_pool_pressure_evicts_a_tenant_without_quota_never_one_within(
    pool: MemoryPool,
) -> None:
    """The pool (64 pages) fills with b's chunks (within b's quota) and c's (no quota):
    room for more is made from c's chunks only, oldest first, and when c has nothing
    left an allocation fails rather than take b's."""
    cpu = CPUBackend(pool, limits=limits(b=32 * PAGE))
    b_keys = [key(B) for _ in range(32)]
    c_keys = [key(C) for _ in range(32)]
    cpu_put(cpu, pool, b_keys)
    cpu_put(cpu, pool, c_keys)
    assert pool.stats().free_bytes == 0
    more = [key(C) for _ in range(40)]
    assert cpu_put(cpu, pool, more) == 40  # each allocation evicts c's oldest
    cpu_check(cpu, b_keys)
    cpu_check(cpu, more[-32:])
    assert all(k not in cpu for k in c_keys + more[:8])
    usage = cpu.stats().tenants
    assert (usage[tag_hex(C)].evictions, usage[tag_hex(B)].evictions) == (40, 0)
    # Larger than all of c's chunks together: nothing of b's is taken to make it fit.
    assert pool.allocate_nowait((33 * PAGE,), torch.uint8) is None
    cpu_check(cpu, b_keys)
    assert len(cpu) == 32
    cpu.clear_nowait()


def test_cpu_a_put_its_quota_cannot_take_is_skipped_and_counted(pool: MemoryPool) -> None:
    chunk = PAGE // 2
    cpu = CPUBackend(pool, limits=limits(a=2 * chunk, b=chunk // 2))
    a_keys = [key(A) for _ in range(2)]
    cpu_put(cpu, pool, a_keys)
    pins = PinSets(timeout=60.0, clock=lambda: 0.0)
    pins.add("lookup", cpu.pin_prefix_nowait(a_keys))  # a's whole quota pinned
    used = pool.stats().used_bytes
    late = key(A)
    assert cpu_put(cpu, pool, [late]) == 0
    assert late not in cpu
    assert pool.stats().used_bytes == used, "the refused chunk's memory went back"
    assert cpu_put(cpu, pool, [key(B)]) == 0, "a chunk larger than b's whole quota"
    assert cpu.quota_refusals == 2
    cpu_check(cpu, a_keys)
    pins.release("lookup")
    assert cpu_put(cpu, pool, [late]) == 1, "the quota takes it once a's chunks may go"
    cpu_check(cpu, [a_keys[1], late])
    cpu.clear_nowait()


def test_cpu_erase_removes_exactly_the_tenants_chunks(pool: MemoryPool) -> None:
    cpu = CPUBackend(pool, limits=limits(b=64 * PAGE))
    b_keys = [key(B) for _ in range(5)]
    cpu_put(cpu, pool, b_keys)
    used_before = pool.stats().used_bytes
    a_keys = [key(A) for _ in range(6)]
    cpu_put(cpu, pool, a_keys)
    pins = PinSets(timeout=60.0, clock=lambda: 0.0)
    pins.add("lookup", cpu.pin_prefix_nowait(a_keys[2:4]))
    held = cpu.get_nowait([a_keys[5]])  # a reader holds one too
    assert sorted(cpu.erase_tenant_nowait(A)) == sorted(a_keys)
    # Pinned or not, a lookup finds none of a's chunks any more.
    assert cpu.contains_prefix_nowait(a_keys[2:4]) == 0
    assert cpu.get_nowait(a_keys) == [None] * 6
    assert cpu.pin_prefix_nowait(a_keys) == []
    cpu_check(cpu, b_keys)
    usage = cpu.stats().tenants
    assert (usage[tag_hex(A)].chunks, usage[tag_hex(A)].bytes, usage[tag_hex(A)].erased) == (
        0,
        0,
        6,
    )
    assert usage[tag_hex(B)].chunks == 5
    assert cpu.stats().chunks == 5
    # The pinned and the referenced chunks' memory goes back when their last user ends.
    assert pool.stats().used_bytes == used_before + 3 * PAGE
    pins.release("lookup")
    assert pool.stats().used_bytes == used_before + PAGE
    for obj in held:
        assert obj is not None
        obj.unref()
    assert pool.stats().used_bytes == used_before
    assert cpu.erase_tenant_nowait(A) == []
    cpu.clear_nowait()


@pytest.mark.anyio
async def test_cpu_erase_tenant_counts_and_checks_the_tag(pool: MemoryPool) -> None:
    cpu = CPUBackend(pool)
    cpu_put(cpu, pool, [key(A), key(A), key(B)])
    assert await cpu.erase_tenant(A) == 2
    assert cpu.stats().tenants[tag_hex(B)].chunks == 1
    with pytest.raises(ValueError, match="tenant tag"):
        await cpu.erase_tenant(b"abc")
    await cpu.aclose()


# --------------------------------------------------------------------------- disk tier


async def open_disk(
    directory: Path, pool: MemoryPool, *, cap: int = 1 << 30, quotas: TenantLimits | None = None
) -> DiskBackend:
    """An open tier whose index is complete."""
    disk = await DiskBackend.open(
        directory,
        pool=pool,
        spec=make_spec(),
        allocation_timeout=1.0,
        max_local_disk_size=cap,
        limits=quotas,
    )
    with anyio.fail_after(30):
        await disk.wait_index(audited=True)
    return disk


async def file_size(tmp_path: Path, pool: MemoryPool) -> int:
    """Bytes of one record file (every chunk here makes a file of that size)."""
    disk = await open_disk(tmp_path / "sizing", pool)
    try:
        await disk_put(disk, pool, [key(C)])
        return disk.stats().bytes
    finally:
        await disk.aclose()


async def disk_put(disk: DiskBackend, pool: MemoryPool, keys: list[ChunkKey]) -> int:
    objs = [new_obj(pool, k) for k in keys]
    try:
        return await disk.put(keys, objs)
    finally:
        for obj in objs:
            obj.unref()


async def disk_check(disk: DiskBackend, keys: list[ChunkKey]) -> None:
    """Every key is served with exactly its bytes."""
    got = await disk.get(keys)
    try:
        for k, obj in zip(keys, got, strict=True):
            assert obj is not None, f"chunk {k.to_str()} missing"
            assert torch.equal(raw(obj), payload(k, obj.nbytes))
    finally:
        for obj in got:
            if obj is not None:
                obj.unref()


def files_of(directory: Path, tag: bytes) -> list[Path]:
    """Every file (records and temporary files) of the tenant under ``directory``."""
    found = []
    for path in directory.rglob("*"):
        name = path.name
        if name.startswith(TEMP_PREFIX):
            name = name.split("-", 3)[-1]  # .tmp-<pid>-<random>-<record's name>
        if name.startswith(tag_hex(tag)) and name.endswith(CHUNK_SUFFIX):
            found.append(path)
    return sorted(found)


def held(usage: object) -> dict[str, tuple[int, int]]:
    assert isinstance(usage, MappingProxyType)
    return {tag: (u.chunks, u.bytes) for tag, u in usage.items()}


@pytest.mark.anyio
async def test_disk_a_tenant_past_its_quota_evicts_only_its_own_files(
    tmp_path: Path, pool: MemoryPool
) -> None:
    size = await file_size(tmp_path, pool)
    with anyio.fail_after(60):
        quotas = limits(a=3 * size, b=3 * size)
        disk = await open_disk(tmp_path / "cache", pool, quotas=quotas)
        try:
            b_keys = [key(B) for _ in range(3)]
            assert await disk_put(disk, pool, b_keys) == 3
            a_keys = [key(A) for _ in range(30)]  # 10 times a's quota
            for i in range(0, 30, 2):
                assert await disk_put(disk, pool, a_keys[i : i + 2]) == 2
            # One put of more than the quota: the chunks past it are refused.
            burst = [key(A) for _ in range(5)]
            assert await disk_put(disk, pool, burst) == 3
            assert disk.quota_refusals == 2
            await disk_check(disk, b_keys)
            await disk_check(disk, burst[:3])
            assert all(k not in disk for k in a_keys + burst[3:])
            usage = disk.stats().tenants
            assert usage[tag_hex(A)].bytes <= 3 * size
            assert (usage[tag_hex(A)].chunks, usage[tag_hex(A)].evictions) == (3, 30)
            assert (usage[tag_hex(B)].chunks, usage[tag_hex(B)].evictions) == (3, 0)
            assert len(files_of(tmp_path / "cache", A)) == 3
        finally:
            await disk.aclose()


@pytest.mark.anyio
async def test_disk_capacity_evicts_a_tenant_without_quota_never_one_within(
    tmp_path: Path, pool: MemoryPool
) -> None:
    """The tier holds 8 files; a and b may hold 4 each."""
    size = await file_size(tmp_path, pool)
    with anyio.fail_after(60):
        quotas = limits(a=4 * size, b=4 * size)
        disk = await open_disk(tmp_path / "cache", pool, cap=8 * size, quotas=quotas)
        try:
            b_keys = [key(B) for _ in range(4)]
            await disk_put(disk, pool, b_keys)
            c_keys = [key(C) for _ in range(10)]
            for k in c_keys:
                assert await disk_put(disk, pool, [k]) == 1
            await disk_check(disk, b_keys)
            await disk_check(disk, c_keys[-4:])
            assert all(k not in disk for k in c_keys[:6])
            # a fills its quota: room comes from c's files, as b is within its own.
            a_keys = [key(A) for _ in range(4)]
            assert await disk_put(disk, pool, a_keys[:3]) == 3
            assert await disk_put(disk, pool, a_keys[3:]) == 1
            assert all(k not in disk for k in c_keys)
            # Only files of tenants within their quotas are left: c's write is skipped...
            assert await disk_put(disk, pool, [key(C)]) == 0
            assert disk.quota_refusals == 1
            # ... while a still makes room within its own quota.
            newer = key(A)
            assert await disk_put(disk, pool, [newer]) == 1
            assert a_keys[0] not in disk
            await disk_check(disk, [*a_keys[1:], newer, *b_keys])
            usage = disk.stats().tenants
            assert (usage[tag_hex(A)].evictions, usage[tag_hex(B)].evictions) == (1, 0)
            assert usage[tag_hex(C)].evictions == 10
            assert disk.stats().bytes == 8 * size
        finally:
            await disk.aclose()


@pytest.mark.anyio
async def test_disk_erase_removes_exactly_the_tenants_files_also_after_a_restart(
    tmp_path: Path, pool: MemoryPool
) -> None:
    root = tmp_path / "cache"
    size = await file_size(tmp_path, pool)
    quotas = limits(a=100 * size, b=100 * size)
    with anyio.fail_after(60):
        disk = await open_disk(root, pool, quotas=quotas)
        a_keys = [key(A) for _ in range(6)]
        b_keys = [key(B) for _ in range(4)]
        c_keys = [key(C) for _ in range(2)]
        try:
            await disk_put(disk, pool, a_keys + b_keys + c_keys)
            usage = held(disk.stats().tenants)
        finally:
            await disk.aclose()
        # Usage by tenant is rebuilt from the files at open.
        disk = await open_disk(root, pool, quotas=quotas)
        try:
            assert held(disk.stats().tenants) == usage
            # Files of a that this tier does not know: another process's record, and a
            # write under way elsewhere (its temporary file).
            other = await open_disk(root, pool)
            stranger = key(A)
            try:
                await disk_put(other, pool, [stranger])
            finally:
                await other.aclose()
            ghost = key(A).to_str()
            temp = root / ghost[:2] / f"{TEMP_PREFIX}{os.getpid()}-0badf00d-{ghost}{CHUNK_SUFFIX}"
            temp.write_bytes(b"partial")
            assert stranger not in disk and len(files_of(root, A)) == 8
            assert await disk.erase_tenant(A) == 7
            assert files_of(root, A) == [], "no file of a is left"
            assert await disk.get(a_keys) == [None] * 6
            assert await disk.contains_prefix(a_keys) == 0
            await disk_check(disk, b_keys + c_keys)
            after = disk.stats().tenants
            assert (after[tag_hex(A)].chunks, after[tag_hex(A)].erased) == (0, 7)
            assert held(after)[tag_hex(B)] == usage[tag_hex(B)]
            assert disk.stats().chunks == 6
            usage = held(after)
        finally:
            await disk.aclose()
        disk = await open_disk(root, pool, quotas=quotas)
        try:
            assert await disk.get([*a_keys, stranger]) == [None] * 7
            assert held(disk.stats().tenants) == {
                tag: u for tag, u in usage.items() if tag != tag_hex(A)
            }
            await disk_check(disk, b_keys + c_keys)
            assert await disk.erase_tenant(A) == 0
        finally:
            await disk.aclose()


@pytest.mark.anyio
async def test_disk_erase_waits_for_a_write_under_way_and_drops_one_queued(
    tmp_path: Path, pool: MemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write of the tenant under way when the erasure is asked for ends first and its
    file is then deleted; a put called before the erasure ended but still waiting for
    the tier writes nothing of the tenant afterwards (another tenant's chunks it holds
    are written)."""
    root = tmp_path / "cache"
    disk = await open_disk(root, pool)
    entered = anyio.Event()
    release = threading.Event()
    encode = disk_file.encode_batch
    first = [True]

    def gated(spec: RecordSpec, batch: list[tuple[bytes, MemoryObj]]) -> Encoded:
        if first[0]:
            first[0] = False
            anyio.from_thread.run_sync(entered.set)
            release.wait(30)
        return encode(spec, batch)

    monkeypatch.setattr("lmcache_async.backends.disk_changes.encode_batch", gated)
    a_first, a_queued, b_queued = key(A), key(A), key(B)
    results: dict[str, int] = {}

    async def run(name: str, call: Awaitable[int]) -> None:
        results[name] = await call

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "first", disk_put(disk, pool, [a_first]))
                await entered.wait()
                tg.start_soon(run, "erase", disk.erase_tenant(A))
                await anyio.wait_all_tasks_blocked()
                tg.start_soon(run, "queued", disk_put(disk, pool, [a_queued, b_queued]))
                await anyio.wait_all_tasks_blocked()
                release.set()
        assert results == {"first": 1, "erase": 1, "queued": 1}
        assert files_of(root, A) == []
        assert a_first not in disk and a_queued not in disk
        await disk_check(disk, [b_queued])
        # A put called after the erasure returned stores the tenant's chunks again.
        assert await disk_put(disk, pool, [a_queued]) == 1
        await disk_check(disk, [a_queued])
    finally:
        release.set()
        await disk.aclose()
