"""Tests for lmcache_async.memory.pinning and the pool's pinned arena: exactly the configured
bytes are registered with CUDA, once, and unregistered once; without CUDA nothing is called;
a failed registration leaves a working, unpinned pool.

The CPU tests stand a recorder in for ``torch.cuda.cudart()``; the CUDA tests use the real one.
"""

from __future__ import annotations

import gc
import mmap
import threading
from typing import Any

import anyio
import pytest
import structlog
import torch

from lmcache_async import CacheEngine, EngineConfig, KVLayout
from lmcache_async.errors import InvalidInputError
from lmcache_async.memory.pinning import HOST_REGISTER_PORTABLE, register_host
from lmcache_async.memory.pool import MemoryPool
from lmcache_async.rpc.protocol import to_wire
from lmcache_async.stats import PoolStats
from tests.memory.cuda_host import is_host_registered

PAGE = 256
GiB = 1 << 30


class StandInCudart:
    """Records ``cudaHostRegister`` / ``cudaHostUnregister`` calls (and the thread of each)
    and answers with the codes it was given, or raises ``raises`` from a register."""

    def __init__(
        self, register_code: int = 0, unregister_code: int = 0, raises: bool = False
    ) -> None:
        self.register_code = register_code
        self.unregister_code = unregister_code
        self.raises = raises
        self.calls: list[tuple[Any, ...]] = []
        self.threads: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        self.threads.append(threading.get_ident())
        if self.raises:
            raise RuntimeError("stand-in register failure")
        return self.register_code

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        self.threads.append(threading.get_ident())
        return self.unregister_code

    def cudaError(self, code: int) -> int:
        return code

    def cudaGetErrorString(self, error: int) -> str:
        return f"stand-in error {error}"

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [call for call in self.calls if call[0] == kind]


class StandInCuda:
    """``torch.cuda`` as the pool sees it on a CUDA machine: available, current device 3."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cudart: StandInCudart) -> None:
        self.cudart = cudart
        self.cudart_calls = 0
        self.set_devices: list[tuple[int, int]] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "cudart", self._cudart)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
        monkeypatch.setattr(torch.cuda, "set_device", self._set_device)

    def _cudart(self) -> StandInCudart:
        self.cudart_calls += 1
        return self.cudart

    def _set_device(self, device: int) -> None:
        self.set_devices.append((device, threading.get_ident()))


@pytest.fixture
def cudart() -> StandInCudart:
    return StandInCudart()


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch, cudart: StandInCudart) -> StandInCuda:
    return StandInCuda(monkeypatch, cudart)


def first_page_ptr(pool: MemoryPool) -> int:
    """Address of the arena's first page (where its first allocation lands)."""
    obj = pool.allocate_nowait((PAGE,), torch.uint8)
    assert obj is not None
    ptr = obj.tensor.data_ptr()
    obj.unref()
    return ptr


def pinned(pool: MemoryPool) -> bool:
    """``pool.pinned`` read afresh (a plain attribute read would stay narrowed for mypy
    across ``close()``)."""
    return pool.pinned


def empty_stats(pool: MemoryPool, pinned_bytes: int) -> PoolStats:
    return PoolStats(
        capacity_bytes=pool.capacity_bytes,
        used_bytes=0,
        free_bytes=pool.capacity_bytes,
        num_objects=0,
        pinned_objects=0,
        waiters=0,
        largest_free_bytes=pool.capacity_bytes,
        pinned_bytes=pinned_bytes,
    )


# -- without CUDA ---------------------------------------------------------------------------


def test_without_cuda_nothing_is_pinned_and_no_cuda_call_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recorder = StandInCudart()
    cuda = StandInCuda(monkeypatch, recorder)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pools = [
        MemoryPool(4 * PAGE, page_size=PAGE),
        MemoryPool(4 * PAGE, page_size=PAGE, pin_memory=False),
        MemoryPool.from_buffer(bytearray(8 * PAGE + 4096), page_size=PAGE),
    ]
    with pytest.raises(InvalidInputError, match="arena"):
        MemoryPool(4 * PAGE, page_size=PAGE, pin_memory=True)
    for pool in pools:
        assert pool.pinned is False
        assert pool.pinned_bytes == 0
        assert pool.stats().pinned_bytes == 0
        pool.close()
    del pools
    gc.collect()
    assert recorder.calls == []
    assert cuda.cudart_calls == 0
    assert cuda.set_devices == []


def test_pool_stats_keep_working_without_pinned_bytes() -> None:
    """Code that builds PoolStats without the new field still works (it defaults to 0)."""
    stats = PoolStats(
        capacity_bytes=PAGE,
        used_bytes=0,
        free_bytes=PAGE,
        num_objects=0,
        pinned_objects=0,
        waiters=0,
        largest_free_bytes=PAGE,
    )
    assert stats.pinned_bytes == 0


# -- with a stand-in CUDA -------------------------------------------------------------------


def test_registers_exactly_the_capacity_once_and_unregisters_once_on_close(
    cuda: StandInCuda, cudart: StandInCudart
) -> None:
    pool = MemoryPool(13 * PAGE + 100, page_size=PAGE)  # 3328 bytes: no power of two
    assert pool.capacity_bytes == 13 * PAGE
    ptr = first_page_ptr(pool)
    assert ptr % 4096 == 0
    assert cudart.calls == [("register", ptr, 13 * PAGE, HOST_REGISTER_PORTABLE)]
    assert pool.pinned is True
    assert pool.pinned_bytes == 13 * PAGE
    assert pool.stats() == empty_stats(pool, pinned_bytes=13 * PAGE)

    live = pool.allocate_nowait((2, PAGE), torch.uint8)
    assert live is not None
    pool.close()
    assert cudart.of("unregister") == [("unregister", ptr)]
    assert pinned(pool) is False
    assert pool.stats().pinned_bytes == 0
    # An object alive at close stays usable (now in pageable memory) until its unref.
    live.tensor.fill_(7)
    assert int(live.tensor.sum()) == 7 * 2 * PAGE
    live.unref()

    pool.close()
    del pool, live
    gc.collect()
    assert len(cudart.of("register")) == 1
    assert len(cudart.of("unregister")) == 1


def test_explicit_pin_memory_registers_and_false_or_a_buffer_never_does(
    cuda: StandInCuda, cudart: StandInCudart
) -> None:
    MemoryPool(4 * PAGE, page_size=PAGE, pin_memory=False).close()
    MemoryPool.from_buffer(bytearray(8 * PAGE + 4096), page_size=PAGE).close()
    with pytest.raises(InvalidInputError, match="buffer"):
        MemoryPool(4 * PAGE, page_size=PAGE, pin_memory=True, buffer=bytearray(8 * PAGE))
    assert cudart.calls == []
    assert cuda.cudart_calls == 0
    pool = MemoryPool(4 * PAGE, page_size=PAGE, pin_memory=True)
    assert pool.pinned
    assert [c[0] for c in cudart.calls] == ["register"]
    pool.close()


def test_register_and_unregister_run_on_their_own_thread_on_the_callers_device(
    cuda: StandInCuda, cudart: StandInCudart
) -> None:
    pool = MemoryPool(4 * PAGE, page_size=PAGE)
    pool.close()
    caller = threading.get_ident()
    assert len(cudart.threads) == 2
    assert caller not in cudart.threads
    # Each call's thread made the caller's current device its own before calling CUDA.
    assert [(device, thread) for device, thread in cuda.set_devices] == [
        (3, thread) for thread in cudart.threads
    ]


def test_the_pinned_arenas_os_pages_belong_to_its_allocation_alone(cuda: StandInCuda) -> None:
    """CUDA locks whole OS pages: a page shared with another arena's registration would
    make one of them fail, so the pages the arena touches must lie inside its allocation."""
    page = mmap.PAGESIZE
    for capacity in (PAGE, 3 * PAGE, 17 * PAGE, 300 * PAGE):
        pool = MemoryPool(capacity, page_size=PAGE)
        storage = pool._arena.untyped_storage()
        start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        ptr = first_page_ptr(pool)
        assert ptr % page == 0
        assert start <= ptr
        assert ptr + -(-pool.capacity_bytes // page) * page <= end
        pool.close()


@pytest.mark.parametrize("code", [2, 712])  # out of memory; host memory already registered
def test_a_failed_registration_leaves_a_working_unpinned_pool(
    monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    cudart = StandInCudart(register_code=code)
    StandInCuda(monkeypatch, cudart)
    with structlog.testing.capture_logs() as logs:
        pool = MemoryPool(8 * PAGE, page_size=PAGE)
    assert pool.pinned is False
    assert pool.pinned_bytes == 0
    assert pool.stats() == empty_stats(pool, pinned_bytes=0)
    [warning] = [e for e in logs if e["event"] == "host_arena_not_pinned"]
    assert warning["log_level"] == "warning"
    assert warning["code"] == code
    assert warning["nbytes"] == 8 * PAGE
    assert warning["error"] == f"stand-in error {code}"
    _use(pool)
    pool.close()
    del pool
    gc.collect()
    assert [c[0] for c in cudart.calls] == ["register"]


def test_a_registration_that_raises_leaves_a_working_unpinned_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cudart = StandInCudart(raises=True)
    StandInCuda(monkeypatch, cudart)
    with structlog.testing.capture_logs() as logs:
        pool = MemoryPool(8 * PAGE, page_size=PAGE)
    assert pool.pinned is False
    assert pool.stats().pinned_bytes == 0
    [warning] = [e for e in logs if e["event"] == "host_arena_not_pinned"]
    assert "stand-in register failure" in warning["error"]
    _use(pool)
    pool.close()
    assert [c[0] for c in cudart.calls] == ["register"]


def test_cuda_that_cannot_start_leaves_a_working_unpinned_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    StandInCuda(monkeypatch, StandInCudart())

    def broken() -> StandInCudart:
        raise RuntimeError("cannot re-initialize CUDA in forked subprocess")

    monkeypatch.setattr(torch.cuda, "cudart", broken)
    with structlog.testing.capture_logs() as logs:
        pool = MemoryPool(8 * PAGE, page_size=PAGE)
    assert pool.pinned is False
    assert pool.stats().pinned_bytes == 0
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["host_arena_not_pinned"]
    _use(pool)
    pool.close()


def test_a_failed_unregister_is_logged_once_and_close_does_not_raise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cudart = StandInCudart(unregister_code=1)
    StandInCuda(monkeypatch, cudart)
    pool = MemoryPool(4 * PAGE, page_size=PAGE)
    with structlog.testing.capture_logs() as logs:
        pool.close()
        pool.close()
    assert pool.pinned is False
    assert pool.stats().pinned_bytes == 0
    [warning] = [e for e in logs if e["event"] == "host_unregister_failed"]
    assert warning["code"] == 1
    del pool
    gc.collect()
    assert [c[0] for c in cudart.calls] == ["register", "unregister"]


def test_a_pool_collected_unclosed_unregisters_once(
    cuda: StandInCuda, cudart: StandInCudart
) -> None:
    pool = MemoryPool(4 * PAGE, page_size=PAGE)
    ptr = first_page_ptr(pool)
    del pool
    gc.collect()
    assert cudart.calls[1:] == [("unregister", ptr)]


def test_register_host_returns_the_exact_range(cuda: StandInCuda, cudart: StandInCudart) -> None:
    registration = register_host(0x10000, 3 * GiB + 1)
    assert registration is not None
    assert (registration.ptr, registration.nbytes) == (0x10000, 3 * GiB + 1)
    assert cudart.calls == [("register", 0x10000, 3 * GiB + 1, HOST_REGISTER_PORTABLE)]
    registration.release()
    registration.release()
    assert registration.released
    assert cudart.calls[1:] == [("unregister", 0x10000)]


def _use(pool: MemoryPool) -> None:
    """Allocate, write, read and free through ``pool``: it works."""
    obj = pool.allocate_nowait((4, PAGE), torch.uint8)
    assert obj is not None
    obj.tensor.copy_(torch.arange(4 * PAGE, dtype=torch.int64).to(torch.uint8).view(4, PAGE))
    assert int(obj.tensor[1, 3]) == (PAGE + 3) % 256
    obj.unref()
    assert pool.stats().used_bytes == 0


# -- through the engine ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_engine_stats_and_their_wire_form_carry_pinned_bytes() -> None:
    layout = KVLayout.vllm_flash_attn(
        num_layers=1, block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    config = EngineConfig(chunk_size=16, max_local_cpu_size=0.001)
    with anyio.fail_after(30):
        async with CacheEngine.open(config, layout, model_name="pinning") as engine:
            pool = engine.stats().pool
            assert pool.pinned_bytes == (pool.capacity_bytes if torch.cuda.is_available() else 0)
            assert to_wire(engine.stats())["pool"]["pinned_bytes"] == pool.pinned_bytes


# -- with CUDA ------------------------------------------------------------------------------


@pytest.mark.cuda
def test_a_pool_of_three_gib_and_a_page_pins_exactly_that() -> None:
    """Not 4 GiB (what the caching host allocator would round it to): the exact capacity is
    registered (CUDA reports its first and last byte as registered host memory), copies to
    and from both ends of the arena run non_blocking, and close unregisters it."""
    size = 3 * GiB + PAGE
    torch.cuda.init()  # type: ignore[no-untyped-call]
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    pool = MemoryPool(size, page_size=PAGE)
    assert pool.capacity_bytes == size
    assert pool.pinned
    assert pool.stats().pinned_bytes == size
    after = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    assert after - before < size  # torch's pinned allocator did not hold the arena

    whole = pool.allocate_nowait((size,), torch.uint8)
    assert whole is not None
    # Not Tensor.is_pinned(): under torch 2.11 it is False for memory torch did not pin.
    first, last = whole.tensor.data_ptr(), whole.tensor.data_ptr() + size - 1
    assert is_host_registered(first)
    assert is_host_registered(last)
    chunk = 64 << 20
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        for host in (whole.tensor[:chunk], whole.tensor[size - chunk - 1 :]):
            device = torch.randint(0, 256, (host.numel(),), dtype=torch.uint8, device="cuda")
            host.copy_(device, non_blocking=True)  # D2H into the pinned arena
            back = torch.empty_like(device)
            back.copy_(host, non_blocking=True)  # H2D out of it
            stream.synchronize()
            assert torch.equal(back, device)
            assert torch.equal(host, device.cpu())

    pool.close()
    assert not pinned(pool)
    assert pool.stats().pinned_bytes == 0
    assert not is_host_registered(first)  # unregistered: pageable again
    assert not is_host_registered(last)
    whole.unref()


@pytest.mark.cuda
def test_pools_next_to_each_other_both_pin() -> None:
    """Small arenas share heap pages unless each owns its pages: both must register."""
    pools = [MemoryPool(3 * PAGE, page_size=PAGE) for _ in range(8)]
    assert all(pool.pinned for pool in pools)
    for pool in pools:
        pool.close()


@pytest.mark.cuda
def test_cuda_reports_pinned_memory_as_registered_and_pageable_memory_as_not() -> None:
    """The check the tests above rely on tells torch's own pinned memory from pageable
    memory, and a range registered and unregistered by hand."""
    pinned_tensor = torch.empty(4 * PAGE, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(4 * PAGE, dtype=torch.uint8)
    assert is_host_registered(pinned_tensor.data_ptr())
    assert not is_host_registered(pageable.data_ptr())
    buffer = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    view = torch.frombuffer(buffer, dtype=torch.uint8)
    ptr, nbytes = view.data_ptr(), view.numel()
    registration = register_host(ptr, nbytes)
    try:
        assert registration is not None
        assert is_host_registered(ptr)
        assert is_host_registered(ptr + nbytes - 1)
    finally:
        if registration is not None:
            registration.release()
    assert not is_host_registered(ptr)
    del view
    buffer.close()
