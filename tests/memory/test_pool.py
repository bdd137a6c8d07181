"""Tests for lmcache_async.memory.pool: the paged host arena, its objects and async allocation."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import anyio
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache_async.errors import AllocationTimeoutError, EngineClosedError, InvalidInputError
from lmcache_async.memory.pool import DEFAULT_PAGE_SIZE, MemoryObj, MemoryPool
from lmcache_async.stats import PoolStats
from tests.memory.cuda_host import is_host_registered

PAGE = 256
TIMEOUT = 5.0


def make_pool(pages: int = 16, evictor: Callable[[int], int] | None = None) -> MemoryPool:
    return MemoryPool(pages * PAGE, page_size=PAGE, pin_memory=False, evictor=evictor)


def pages_obj(pool: MemoryPool, n: int) -> MemoryObj:
    """Allocate exactly ``n`` pages (as uint8) without waiting; fail the test if no room."""
    obj = pool.allocate_nowait((n * PAGE,), torch.uint8)
    assert obj is not None
    return obj


def empty_stats(pool: MemoryPool) -> PoolStats:
    return PoolStats(
        capacity_bytes=pool.capacity_bytes,
        used_bytes=0,
        free_bytes=pool.capacity_bytes,
        num_objects=0,
        pinned_objects=0,
        waiters=0,
        largest_free_bytes=pool.capacity_bytes,
    )


def span(obj: MemoryObj, pool: MemoryPool, base: int) -> tuple[int, int]:
    """Byte range ``[start, end)`` of the pages ``obj`` holds, relative to the arena start."""
    start = obj.tensor.data_ptr() - base
    npages = -(-obj.nbytes // pool.page_size)
    return start, start + npages * pool.page_size


# -- construction --------------------------------------------------------------------------


def test_construction_rounds_capacity_and_reports_properties() -> None:
    pool = MemoryPool(10 * PAGE + 100, page_size=PAGE, pin_memory=False)
    assert pool.capacity_bytes == 10 * PAGE
    assert pool.page_size == PAGE
    assert pool.pinned is False
    assert pool.closed is False
    assert pool.stats() == empty_stats(pool)
    tiny = MemoryPool(10, page_size=PAGE, pin_memory=False)
    assert tiny.capacity_bytes == PAGE
    assert MemoryPool(DEFAULT_PAGE_SIZE, pin_memory=False).page_size == 64 * 1024


@pytest.mark.parametrize(
    ("capacity", "page_size"),
    [(0, PAGE), (-1, PAGE), (PAGE, 0), (PAGE, -256), (PAGE, 100), (PAGE, 257), (1.5, PAGE)],
)
def test_construction_rejects_bad_sizes(capacity: object, page_size: object) -> None:
    with pytest.raises(InvalidInputError):
        MemoryPool(capacity, page_size=page_size, pin_memory=False)  # type: ignore[arg-type]


def test_pin_memory_default_follows_cuda() -> None:
    pool = MemoryPool(4 * PAGE, page_size=PAGE)
    assert pool.pinned is torch.cuda.is_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinned memory works with CUDA")
def test_pin_memory_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(InvalidInputError, match="arena"):
        MemoryPool(4 * PAGE, page_size=PAGE, pin_memory=True)


@pytest.mark.cuda
def test_pinned_arena_round_trips_through_the_gpu() -> None:
    pool = MemoryPool(8 * PAGE, page_size=PAGE, pin_memory=True)
    assert pool.pinned
    obj = pages_obj(pool, 2)
    # CUDA's own word (Tensor.is_pinned() is False for memory torch did not pin).
    assert is_host_registered(obj.tensor.data_ptr())
    obj.tensor.copy_(torch.arange(2 * PAGE, dtype=torch.int64).to(torch.uint8))
    back = obj.tensor.to("cuda", non_blocking=True).cpu()
    assert torch.equal(back, obj.tensor)
    obj.unref()


# -- allocation basics ---------------------------------------------------------------------


def test_allocate_and_free_returns_stats_to_zero() -> None:
    pool = make_pool(16)
    a = pool.allocate_nowait((3, 100), torch.float32)  # 1200 B -> 5 pages
    b = pool.allocate_nowait((2, 4, 8), torch.bfloat16)  # 128 B -> 1 page
    assert a is not None
    assert b is not None
    assert a.shape == (3, 100)
    assert a.dtype == torch.float32
    assert a.nbytes == 1200
    assert a.tensor.shape == (3, 100)
    assert a.tensor.dtype == torch.float32
    assert b.nbytes == 128
    assert b.tensor.shape == (2, 4, 8)
    stats = pool.stats()
    assert stats.used_bytes == 6 * PAGE
    assert stats.free_bytes == 10 * PAGE
    assert stats.num_objects == 2
    assert stats.largest_free_bytes == 10 * PAGE
    a.unref()
    b.unref()
    assert a.freed
    assert b.freed
    assert pool.stats() == empty_stats(pool)


def test_shape_accepts_torch_size_and_exact_page_multiples() -> None:
    pool = make_pool(4)
    obj = pool.allocate_nowait(torch.Size([2, PAGE // 4]), torch.int32)  # exactly 2 pages
    assert obj is not None
    assert obj.shape == (2, PAGE // 4)
    assert pool.stats().used_bytes == 2 * PAGE
    obj.unref()


@pytest.mark.parametrize(
    "dtype",
    [
        torch.uint8,
        torch.bool,
        torch.int16,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.int64,
        torch.float64,
        torch.complex128,
        torch.float8_e4m3fn,
    ],
)
def test_every_view_is_aligned_and_usable(dtype: torch.dtype) -> None:
    pool = make_pool(16)
    # An odd-sized first object shifts the next one by whole pages only.
    first = pool.allocate_nowait((3,), torch.uint8)
    obj = pool.allocate_nowait((5, 7), dtype)
    assert first is not None
    assert obj is not None
    assert obj.tensor.data_ptr() % 256 == 0
    assert obj.tensor.is_contiguous()
    assert obj.nbytes == 35 * dtype.itemsize
    assert obj.tensor.numel() * obj.tensor.element_size() == obj.nbytes
    first.unref()
    obj.unref()


def test_scalar_shape_is_one_element() -> None:
    pool = make_pool(4)
    obj = pool.allocate_nowait((), torch.float32)
    assert obj is not None
    assert obj.tensor.shape == ()
    assert obj.nbytes == 4
    assert pool.stats().used_bytes == PAGE
    obj.unref()


@pytest.mark.parametrize("shape", [(0,), (4, 0), (-1,), (2, -3), ("a",), (1.5,)], ids=repr)
def test_bad_shapes_are_rejected(shape: tuple[object, ...]) -> None:
    pool = make_pool(4)
    with pytest.raises(InvalidInputError):
        pool.allocate_nowait(shape, torch.float32)  # type: ignore[arg-type]
    assert pool.stats() == empty_stats(pool)


def test_bad_dtype_is_rejected() -> None:
    pool = make_pool(4)
    with pytest.raises(InvalidInputError):
        pool.allocate_nowait((4,), "float32")  # type: ignore[arg-type]


def test_writes_through_one_object_never_touch_another() -> None:
    pool = make_pool(32)
    shapes_dtypes = [
        ((7,), torch.uint8),
        ((3, 50), torch.float32),
        ((1,), torch.int64),
        ((PAGE,), torch.uint8),
        ((2, 3, 40), torch.float16),
        ((129,), torch.int16),
    ]
    objs = []
    for shape, dtype in shapes_dtypes:
        obj = pool.allocate_nowait(shape, dtype)
        assert obj is not None
        objs.append(obj)
    # Also fill the page slack behind each payload with a canary, through the raw arena bytes.
    arena_base = min(o.tensor.data_ptr() for o in objs)
    for i, obj in enumerate(objs):
        obj.tensor.view(-1).view(torch.uint8).fill_(i + 1)
    for i, obj in enumerate(objs):
        raw = obj.tensor.view(-1).view(torch.uint8)
        assert torch.equal(raw, torch.full_like(raw, i + 1)), f"object {i} was overwritten"
    ranges = sorted(span(o, pool, arena_base) for o in objs)
    for (_, end), (start, _) in itertools.pairwise(ranges):
        assert end <= start
    for obj in objs:
        obj.unref()


def test_coalescing_after_frees_in_odd_orders() -> None:
    pool = make_pool(12)
    for order in ([0, 2, 4, 1, 3, 5], [5, 3, 1, 0, 4, 2], [2, 3, 1, 4, 0, 5]):
        objs = [pages_obj(pool, 2) for _ in range(6)]
        assert pool.allocate_nowait((1,), torch.uint8) is None
        for i in order:
            objs[i].unref()
        stats = pool.stats()
        assert stats.free_bytes == pool.capacity_bytes
        assert stats.largest_free_bytes == pool.capacity_bytes
        whole = pages_obj(pool, 12)
        whole.unref()
    assert pool.stats() == empty_stats(pool)


def test_fragmentation_shows_in_largest_free_and_blocks_large_requests() -> None:
    pool = make_pool(8)
    objs = [pages_obj(pool, 1) for _ in range(8)]
    for obj in objs[::2]:
        obj.unref()
    stats = pool.stats()
    assert stats.free_bytes == 4 * PAGE
    assert stats.largest_free_bytes == PAGE
    assert pool.allocate_nowait((2 * PAGE,), torch.uint8) is None
    objs[1].unref()  # pages 0..2 now free and merged
    assert pool.stats().largest_free_bytes == 3 * PAGE
    big = pages_obj(pool, 3)
    assert big.tensor.data_ptr() == pool._arena.data_ptr()  # first fit: the lowest run
    big.unref()
    for obj in objs[3::2]:
        obj.unref()
    assert pool.stats() == empty_stats(pool)


def test_oversize_request_is_rejected_at_once() -> None:
    pool = make_pool(4)
    with pytest.raises(InvalidInputError, match="capacity"):
        pool.allocate_nowait((4 * PAGE + 1,), torch.uint8)


@pytest.mark.anyio
async def test_oversize_async_request_raises_without_waiting() -> None:
    pool = make_pool(4)
    with anyio.fail_after(TIMEOUT), pytest.raises(InvalidInputError, match="capacity"):
        await pool.allocate((5 * PAGE,), torch.uint8, timeout=1000.0)
    assert pool.stats().waiters == 0


@pytest.mark.anyio
@pytest.mark.parametrize("timeout", [-1.0, float("nan")])
async def test_bad_timeout_is_rejected(timeout: float) -> None:
    pool = make_pool(4)
    with pytest.raises(InvalidInputError, match="timeout"):
        await pool.allocate((1,), torch.uint8, timeout=timeout)


# -- reference and pin counts --------------------------------------------------------------


def test_ref_unref_keep_pages_until_last_reference() -> None:
    pool = make_pool(4)
    obj = pages_obj(pool, 2)
    assert obj.ref_count == 1
    assert obj.ref() is obj
    assert obj.ref_count == 2
    obj.unref()
    assert obj.ref_count == 1
    assert pool.stats().used_bytes == 2 * PAGE
    obj.tensor.fill_(7)
    obj.unref()
    assert obj.freed
    assert obj.ref_count == 0
    assert pool.stats().used_bytes == 0


def test_data_is_the_payload_bytes_the_tensor_views() -> None:
    pool = MemoryPool(8 * PAGE, page_size=PAGE)
    first = pool.allocate_nowait((3, PAGE // 4 + 1), torch.bfloat16)  # two pages, the 2nd part-full
    second = pool.allocate_nowait((5,), torch.int32)
    assert first is not None and second is not None
    values = torch.arange(first.tensor.numel(), dtype=torch.float32).reshape(first.shape)
    first.tensor.copy_(values.to(torch.bfloat16))
    data = first.data
    assert data.nbytes == first.nbytes == 3 * (PAGE // 4 + 1) * 2
    assert bytes(data) == first.tensor.view(torch.uint8).numpy().tobytes()
    second.data[:] = bytes(range(20))  # writable: the next object's bytes, not the first's
    assert (
        second.tensor.tolist() == torch.frombuffer(bytearray(range(20)), dtype=torch.int32).tolist()
    )
    assert bytes(first.data) == bytes(data)
    first.unref()
    second.unref()


def test_ref_count_errors() -> None:
    pool = make_pool(4)
    obj = pages_obj(pool, 1)
    obj.unref()
    with pytest.raises(EngineClosedError):
        obj.unref()
    with pytest.raises(EngineClosedError):
        obj.ref()
    with pytest.raises(EngineClosedError):
        _ = obj.tensor
    with pytest.raises(EngineClosedError):
        _ = obj.data
    with pytest.raises(EngineClosedError):
        obj.pin()
    # Metadata stays readable after the free.
    assert obj.shape == (PAGE,)
    assert obj.nbytes == PAGE
    assert pool.stats() == empty_stats(pool)


def test_pin_counts_and_errors() -> None:
    pool = make_pool(4)
    obj = pages_obj(pool, 1)
    with pytest.raises(InvalidInputError, match="not pinned"):
        obj.unpin()
    obj.pin()
    obj.pin()
    assert obj.pin_count == 2
    assert pool.stats().pinned_objects == 1
    obj.unpin()
    assert pool.stats().pinned_objects == 1
    obj.unpin()
    assert obj.pin_count == 0
    assert pool.stats().pinned_objects == 0
    with pytest.raises(InvalidInputError):
        obj.unpin()
    obj.unref()


def test_pins_do_not_keep_memory_alive() -> None:
    pool = make_pool(4)
    obj = pages_obj(pool, 2)
    obj.pin()
    obj.unref()
    assert obj.freed
    stats = pool.stats()
    assert stats.used_bytes == 0
    assert stats.pinned_objects == 0
    obj.unpin()  # balancing a pin after the free is allowed
    assert obj.pin_count == 0
    assert pool.stats() == empty_stats(pool)


# -- waiting, timeouts, eviction -----------------------------------------------------------


@pytest.mark.anyio
async def test_allocate_fast_path_does_not_wait() -> None:
    pool = make_pool(4)
    with anyio.fail_after(TIMEOUT):
        obj = await pool.allocate((3, 5), torch.float64, timeout=0)
    assert obj.tensor.shape == (3, 5)
    obj.unref()
    assert pool.stats() == empty_stats(pool)


@pytest.mark.anyio
async def test_allocate_waits_and_is_woken_by_unref() -> None:
    pool = make_pool(4)
    hog = pages_obj(pool, 4)
    got: list[MemoryObj] = []

    async def waiter() -> None:
        got.append(await pool.allocate((2 * PAGE,), torch.uint8, timeout=TIMEOUT))

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            assert pool.stats().waiters == 1
            assert got == []
            hog.unref()
    assert pool.stats().waiters == 0
    assert len(got) == 1
    assert got[0].nbytes == 2 * PAGE
    assert pool.stats().used_bytes == 2 * PAGE
    got[0].unref()
    assert pool.stats() == empty_stats(pool)


@pytest.mark.anyio
async def test_timeout_raises_and_leaves_stats_unchanged() -> None:
    pool = make_pool(4)
    hog = pages_obj(pool, 3)
    hog.pin()
    before = pool.stats()
    with anyio.fail_after(TIMEOUT), pytest.raises(AllocationTimeoutError):
        await pool.allocate((2 * PAGE,), torch.uint8, timeout=0.05)
    assert pool.stats() == before
    with anyio.fail_after(TIMEOUT), pytest.raises(AllocationTimeoutError):
        await pool.allocate((2 * PAGE,), torch.uint8, timeout=0)
    assert pool.stats() == before
    hog.unpin()
    hog.unref()
    assert pool.stats() == empty_stats(pool)


@pytest.mark.anyio
async def test_timed_out_head_lets_smaller_waiter_in() -> None:
    pool = make_pool(4)
    a = pages_obj(pool, 2)
    b = pages_obj(pool, 2)
    results: dict[str, object] = {}

    async def big() -> None:
        try:
            await pool.allocate((4 * PAGE,), torch.uint8, timeout=0.05)
        except AllocationTimeoutError as exc:
            results["big"] = exc

    async def small() -> None:
        results["small"] = await pool.allocate((PAGE,), torch.uint8, timeout=TIMEOUT)

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(big)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(small)
            await anyio.wait_all_tasks_blocked()
            assert pool.stats().waiters == 2
            a.unref()  # 2 pages free: small fits but must queue behind big, until big times out
            await anyio.wait_all_tasks_blocked()
            assert "small" not in results
    assert isinstance(results["big"], AllocationTimeoutError)
    small_obj = results["small"]
    assert isinstance(small_obj, MemoryObj)
    small_obj.unref()
    b.unref()
    assert pool.stats() == empty_stats(pool)


@pytest.mark.anyio
async def test_fifo_large_waiter_served_before_later_small_ones() -> None:
    pool = make_pool(4)
    hogs = [pages_obj(pool, 1) for _ in range(4)]
    order: list[str] = []
    objs: list[MemoryObj] = []

    async def want(name: str, pages: int) -> None:
        obj = await pool.allocate((pages * PAGE,), torch.uint8, timeout=TIMEOUT)
        order.append(name)
        objs.append(obj)

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(want, "large", 3)
            await anyio.wait_all_tasks_blocked()
            for i in range(3):
                tg.start_soon(want, f"small{i}", 1)
                await anyio.wait_all_tasks_blocked()
            assert pool.stats().waiters == 4
            # Each single free would satisfy a small waiter; none may jump the large one.
            hogs[0].unref()
            await anyio.wait_all_tasks_blocked()
            hogs[1].unref()
            await anyio.wait_all_tasks_blocked()
            assert order == []
            assert pool.allocate_nowait((1,), torch.uint8) is None  # nowait does not jump either
            hogs[2].unref()
            await anyio.wait_all_tasks_blocked()
            assert order == ["large"]  # the pool is full again: large 3 pages + hogs[3]
            hogs[3].unref()
            await anyio.wait_all_tasks_blocked()
            assert order == ["large", "small0"]
            objs[0].unref()  # three pages back: both remaining small waiters fit
    assert order == ["large", "small0", "small1", "small2"]
    for obj in objs[1:]:
        obj.unref()
    assert pool.stats() == empty_stats(pool)


class FakeTier:
    """A minimal CPU-tier stand-in: an LRU list of cached objects, evicting the evictable."""

    def __init__(self) -> None:
        self.entries: list[MemoryObj] = []
        self.calls: list[int] = []

    def evict(self, nbytes: int) -> int:
        self.calls.append(nbytes)
        released = 0
        for obj in list(self.entries):
            if released >= nbytes:
                break
            if obj.pin_count == 0 and obj.ref_count == 1:
                self.entries.remove(obj)
                released += obj.nbytes
                obj.unref()
        return released


def test_evictor_called_with_shortfall_and_its_frees_satisfy_request() -> None:
    tier = FakeTier()
    pool = make_pool(8, evictor=tier.evict)
    keep = pages_obj(pool, 2)
    # Pages 2..5; the least recently used (evicted first) are the ones next to the free run.
    tier.entries = [pages_obj(pool, 1) for _ in range(4)][::-1]
    obj = pool.allocate_nowait((4 * PAGE,), torch.uint8)
    assert obj is not None
    assert tier.calls == [2 * PAGE]
    assert len(tier.entries) == 2
    assert pool.stats().used_bytes == 8 * PAGE
    obj.unref()
    keep.unref()
    for entry in tier.entries:
        entry.unref()
    assert pool.stats() == empty_stats(pool)


def test_evictor_that_frees_nothing_gives_none() -> None:
    tier = FakeTier()
    pool = make_pool(4)
    pool.set_evictor(tier.evict)
    pinned = pages_obj(pool, 4)
    pinned.pin()
    tier.entries = [pinned]
    assert pool.allocate_nowait((PAGE,), torch.uint8) is None
    assert tier.calls == [PAGE]
    pool.set_evictor(None)
    assert pool.allocate_nowait((PAGE,), torch.uint8) is None
    assert tier.calls == [PAGE]
    pinned.unpin()
    pinned.unref()


def test_evictor_is_asked_again_until_contiguous_room() -> None:
    tier = FakeTier()
    pool = make_pool(4, evictor=tier.evict)
    tier.entries = [pages_obj(pool, 1) for _ in range(4)]
    # Evict in an order that frees non-adjacent pages first.
    tier.entries = [tier.entries[i] for i in (0, 2, 1, 3)]

    def one_at_a_time(nbytes: int) -> int:
        tier.calls.append(nbytes)
        obj = tier.entries.pop(0)
        obj.unref()
        return PAGE

    pool.set_evictor(one_at_a_time)
    obj = pool.allocate_nowait((2 * PAGE,), torch.uint8)
    assert obj is not None
    # Shortfall is measured against the largest contiguous run: 2 pages, then 1, then 1.
    assert tier.calls == [2 * PAGE, PAGE, PAGE]
    obj.unref()
    for entry in tier.entries:
        entry.unref()
    assert pool.stats() == empty_stats(pool)


@pytest.mark.anyio
async def test_failing_evictor_propagates_and_leaves_pool_consistent() -> None:
    calls: list[int] = []

    def broken(nbytes: int) -> int:
        calls.append(nbytes)
        raise RuntimeError("tier bug")

    pool = make_pool(2, evictor=broken)
    hog = pages_obj(pool, 2)
    before = pool.stats()
    with pytest.raises(RuntimeError, match="tier bug"):
        pool.allocate_nowait((PAGE,), torch.uint8)
    with anyio.fail_after(TIMEOUT), pytest.raises(RuntimeError, match="tier bug"):
        await pool.allocate((PAGE,), torch.uint8, timeout=TIMEOUT)
    assert calls == [PAGE, PAGE]  # asked again each time: no stuck "evicting" state
    assert pool.stats() == before
    hog.unref()
    assert pool.stats() == empty_stats(pool)


@pytest.mark.anyio
async def test_waiter_re_asks_evictor_when_an_entry_becomes_evictable() -> None:
    tier = FakeTier()
    pool = make_pool(4, evictor=tier.evict)
    entry = pages_obj(pool, 4)
    tier.entries = [entry]
    reader = entry.ref()  # a reader holds it: not evictable yet
    got: list[MemoryObj] = []

    async def waiter() -> None:
        got.append(await pool.allocate((PAGE,), torch.uint8, timeout=TIMEOUT))

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            assert tier.calls == [PAGE]
            assert got == []
            reader.unref()  # no pages freed, but the entry is now evictable
    assert len(got) == 1
    assert tier.calls == [PAGE, PAGE]
    assert tier.entries == []
    got[0].unref()
    assert pool.stats() == empty_stats(pool)


@pytest.mark.anyio
async def test_unpin_wakes_waiter_to_retry_eviction() -> None:
    tier = FakeTier()
    pool = make_pool(2, evictor=tier.evict)
    entry = pages_obj(pool, 2)
    entry.pin()
    tier.entries = [entry]
    got: list[MemoryObj] = []

    async def waiter() -> None:
        got.append(await pool.allocate((2 * PAGE,), torch.uint8, timeout=TIMEOUT))

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            assert got == []
            entry.unpin()
    assert len(got) == 1
    got[0].unref()
    assert pool.stats() == empty_stats(pool)


@pytest.mark.anyio
async def test_cancelled_waiter_leaves_no_trace() -> None:
    pool = make_pool(4)
    hog = pages_obj(pool, 4)
    before = pool.stats()
    served: list[MemoryObj] = []

    async def later() -> None:
        served.append(await pool.allocate((PAGE,), torch.uint8, timeout=TIMEOUT))

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()
            tg.start_soon(lambda: _cancellable_allocate(pool, scope))
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(later)
            await anyio.wait_all_tasks_blocked()
            assert pool.stats().waiters == 2
            scope.cancel()
            await anyio.wait_all_tasks_blocked()
            assert pool.stats() == PoolStats(**{**_as_dict(before), "waiters": 1})
            hog.unref()  # the queue moved on: the later waiter is now head and is served
    assert len(served) == 1
    served[0].unref()
    assert pool.stats() == empty_stats(pool)


async def _cancellable_allocate(pool: MemoryPool, scope: anyio.CancelScope) -> None:
    with scope:
        await pool.allocate((4 * PAGE,), torch.uint8, timeout=TIMEOUT)
        pytest.fail("the allocation should have been cancelled")


def _as_dict(stats: PoolStats) -> dict[str, int]:
    return {name: getattr(stats, name) for name in PoolStats.__slots__}


@pytest.mark.anyio
async def test_cancelled_head_lets_next_waiter_in() -> None:
    pool = make_pool(4)
    a = pages_obj(pool, 2)
    b = pages_obj(pool, 2)
    served: list[MemoryObj] = []

    async def small() -> None:
        served.append(await pool.allocate((PAGE,), torch.uint8, timeout=TIMEOUT))

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()
            tg.start_soon(lambda: _cancellable_allocate(pool, scope))
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(small)
            await anyio.wait_all_tasks_blocked()
            a.unref()  # room for small, but big is first in line
            await anyio.wait_all_tasks_blocked()
            assert served == []
            scope.cancel()
    assert len(served) == 1
    served[0].unref()
    b.unref()
    assert pool.stats() == empty_stats(pool)


# -- close ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_close_wakes_waiters_with_engine_closed() -> None:
    pool = make_pool(4)
    hog = pages_obj(pool, 4)
    hog.tensor.fill_(42)
    errors: list[BaseException] = []

    async def waiter() -> None:
        try:
            await pool.allocate((PAGE,), torch.uint8, timeout=TIMEOUT)
        except EngineClosedError as exc:
            errors.append(exc)

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            assert pool.stats().waiters == 3
            pool.close()
            pool.close()  # idempotent
    assert len(errors) == 3
    assert pool.closed
    assert pool.stats().waiters == 0
    # Live objects stay valid after close.
    assert torch.equal(hog.tensor, torch.full((4 * PAGE,), 42, dtype=torch.uint8))
    with pytest.raises(EngineClosedError):
        pool.allocate_nowait((1,), torch.uint8)
    with anyio.fail_after(TIMEOUT), pytest.raises(EngineClosedError):
        await pool.allocate((1,), torch.uint8, timeout=TIMEOUT)
    hog.unref()
    assert pool.stats() == empty_stats(pool)


# -- property: random sequences of allocations and frees ------------------------------------


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/ref/unref/pin sequences keep the accounting exact and objects disjoint."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = MemoryPool(32 * PAGE, page_size=PAGE, pin_memory=False)
        self.base = self.pool._arena.data_ptr()
        self.live: dict[int, tuple[MemoryObj, int]] = {}  # id -> (object, fill byte)
        self.refs: dict[int, int] = {}
        self.next_id = 0

    @rule(
        dims=st.lists(st.integers(1, 24), min_size=1, max_size=3),
        dtype=st.sampled_from([torch.uint8, torch.float16, torch.float32, torch.int64]),
    )
    def allocate(self, dims: list[int], dtype: torch.dtype) -> None:
        nbytes = 1
        for d in dims:
            nbytes *= d
        nbytes *= dtype.itemsize
        npages = -(-nbytes // PAGE)
        if npages > self.pool.capacity_bytes // PAGE:
            with pytest.raises(InvalidInputError, match="capacity"):
                self.pool.allocate_nowait(dims, dtype)
            return
        largest = self.pool.stats().largest_free_bytes // PAGE
        obj = self.pool.allocate_nowait(dims, dtype)
        if npages <= largest:
            assert obj is not None
        else:
            assert obj is None
            return
        assert obj.nbytes == nbytes
        fill = self.next_id % 251 + 1
        obj.tensor.view(-1).view(torch.uint8).fill_(fill)
        self.live[self.next_id] = (obj, fill)
        self.refs[self.next_id] = 1
        self.next_id += 1

    @precondition(lambda self: bool(self.live))
    @rule(pick=st.integers(0, 10**6))
    def add_ref(self, pick: int) -> None:
        key = sorted(self.live)[pick % len(self.live)]
        self.live[key][0].ref()
        self.refs[key] += 1

    @precondition(lambda self: bool(self.live))
    @rule(pick=st.integers(0, 10**6))
    def drop_ref(self, pick: int) -> None:
        key = sorted(self.live)[pick % len(self.live)]
        obj, _ = self.live[key]
        obj.unref()
        self.refs[key] -= 1
        if self.refs[key] == 0:
            assert obj.freed
            del self.live[key]
            del self.refs[key]

    @precondition(lambda self: bool(self.live))
    @rule(pick=st.integers(0, 10**6), pin=st.booleans())
    def toggle_pin(self, pick: int, pin: bool) -> None:
        obj, _ = self.live[sorted(self.live)[pick % len(self.live)]]
        if pin:
            obj.pin()
        elif obj.pin_count > 0:
            obj.unpin()

    @invariant()
    def accounting_is_exact(self) -> None:
        stats = self.pool.stats()
        objs = [obj for obj, _ in self.live.values()]
        expected_used = sum(-(-o.nbytes // PAGE) * PAGE for o in objs)
        assert stats.used_bytes == expected_used
        assert stats.free_bytes == stats.capacity_bytes - expected_used
        assert stats.num_objects == len(objs)
        assert stats.pinned_objects == sum(1 for o in objs if o.pin_count > 0)
        assert stats.largest_free_bytes <= stats.free_bytes
        assert stats.waiters == 0

    @invariant()
    def objects_are_disjoint_and_intact(self) -> None:
        ranges = sorted(span(obj, self.pool, self.base) for obj, _ in self.live.values())
        for start, end in ranges:
            assert 0 <= start < end <= self.pool.capacity_bytes
        for (_, end), (start, _) in itertools.pairwise(ranges):
            assert end <= start
        for obj, fill in self.live.values():
            raw = obj.tensor.view(-1).view(torch.uint8)
            assert bool((raw == fill).all())

    def teardown(self) -> None:
        for key, (obj, _) in self.live.items():
            for _ in range(self.refs[key]):
                obj.unref()
        assert self.pool.stats() == empty_stats(self.pool)


PoolMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_pool_random_sequences = PoolMachine.TestCase


def test_a_payload_keeps_no_tensor_and_each_view_sees_its_bytes() -> None:
    """A view is made when asked for (a torch view costs more than the rest of a cached
    chunk): two views are two tensors over the same bytes; a freed payload has none."""
    pool = MemoryPool(4 * 4096, page_size=4096, pin_memory=False)
    pool.allocate_nowait((4096,), torch.uint8)  # the next one starts at page 1
    obj = pool.allocate_nowait((2, 1, 256, 4), torch.float16)
    assert obj is not None
    assert not hasattr(obj, "__dict__")
    assert "_tensor" not in type(obj).__slots__
    first, second = obj.tensor, obj.tensor
    assert first is not second
    assert first.data_ptr() == second.data_ptr() == pool._arena.data_ptr() + 4096
    assert first.shape == (2, 1, 256, 4) and first.dtype == torch.float16
    assert first.is_contiguous()
    first.fill_(3.0)
    assert bool((second == 3.0).all())
    obj.unref()
    with pytest.raises(EngineClosedError, match="freed"):
        _ = obj.tensor
