"""Tests for lmcache_async.memory.prefault: a pool's pages faulted in behind its start, by a
thread the start never waits for and close stops, without changing a byte anyone wrote."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.memory.pool import MemoryPool
from lmcache_async.memory.prefault import Prefault

MiB = 1 << 20
GiB = 1 << 30
TIMEOUT = 60.0

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise, /proc")


def rss_bytes() -> int:
    """This process's resident memory (``VmRSS``, shared memory included)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


class Hold:
    """An ``on_slice`` hook that stops the worker at slice ``at`` until released."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, offset: int) -> None:
        if offset == self.at:
            self.reached.set()
            assert self.release.wait(TIMEOUT)


@linux_only
def test_a_1_gib_pool_starts_without_waiting_and_its_pages_become_resident() -> None:
    pool = MemoryPool(GiB, pin_memory=False)
    try:
        before = rss_bytes()
        hold = Hold(at=0)
        worker = pool.prefault(on_slice=hold)
        assert worker is not None
        assert hold.reached.wait(TIMEOUT)
        # prefault() returned while its worker is held before the first slice.
        assert worker.running and worker.faulted_bytes == 0
        hold.release.set()
        assert worker.join(TIMEOUT)
        assert worker.faulted_bytes == pool.capacity_bytes
        assert rss_bytes() - before > 0.9 * GiB
        assert pool.prefault() is None  # once per pool
    finally:
        pool.close()


@linux_only
def test_without_prefault_opening_a_pool_touches_no_page() -> None:
    before = rss_bytes()
    pool = MemoryPool(GiB, pin_memory=False)
    try:
        assert rss_bytes() - before < 64 * MiB
    finally:
        pool.close()


@linux_only
def test_close_stops_the_worker_part_way_and_joins_it() -> None:
    pool = MemoryPool(256 * MiB, pin_memory=False)
    hold = Hold(at=4 * MiB)
    worker = pool.prefault(slice_bytes=MiB, on_slice=hold)
    assert worker is not None
    assert hold.reached.wait(TIMEOUT)
    worker.cancel()  # as close() does first; then the held slice is let go
    hold.release.set()
    pool.close()
    assert not worker.running
    assert worker.faulted_bytes == 4 * MiB
    assert pool.prefault() is None  # a closed pool starts none


@linux_only
def test_bytes_written_while_the_pages_fault_in_are_kept() -> None:
    """The worker and the pool's owner write the same pages at once; nothing is lost."""
    pool = MemoryPool(64 * MiB, page_size=64 * 1024, pin_memory=False)
    objs = [pool.allocate_nowait((MiB,), torch.uint8) for _ in range(64)]
    assert all(obj is not None for obj in objs)
    gen = torch.Generator().manual_seed(7)
    data = [torch.randint(0, 256, (MiB,), dtype=torch.uint8, generator=gen) for _ in objs]
    written = threading.Event()

    def write_behind(offset: int) -> None:
        # From the worker: fill the object just ahead of the slice about to be faulted in.
        index = offset // MiB
        if offset % MiB == 0 and index % 2 == 0 and index < len(objs):
            obj = objs[index]
            assert obj is not None
            obj.tensor.copy_(data[index])
        if offset == 32 * MiB:
            written.set()

    worker = pool.prefault(slice_bytes=256 * 1024, on_slice=write_behind)
    assert worker is not None
    for index in range(1, len(objs), 2):  # the odd ones from here, meanwhile
        obj = objs[index]
        assert obj is not None
        obj.tensor.copy_(data[index])
    assert worker.join(TIMEOUT) and written.is_set()
    for obj, expected in zip(objs, data, strict=True):
        assert obj is not None
        assert torch.equal(obj.tensor, expected)
        obj.unref()
    pool.close()


def test_a_slice_must_be_whole_os_pages() -> None:
    arena = torch.empty(4096, dtype=torch.uint8)
    for bad in (0, 100, 4096 + 1, True):
        with pytest.raises(InvalidInputError, match="slice_bytes"):
            Prefault(arena, slice_bytes=bad)


@linux_only
def test_a_pool_larger_than_the_limit_faults_in_its_first_bytes_only() -> None:
    pool = MemoryPool(64 * MiB, pin_memory=False)
    try:
        before = rss_bytes()
        worker = pool.prefault(slice_bytes=4 * MiB, limit_bytes=16 * MiB)
        assert worker is not None
        assert worker.join(TIMEOUT)
        assert worker.faulted_bytes == 16 * MiB
        assert rss_bytes() - before < 48 * MiB  # the rest is untouched
    finally:
        pool.close()


def test_a_limit_must_be_a_positive_int() -> None:
    arena = torch.empty(4096, dtype=torch.uint8)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidInputError, match="limit_bytes"):
            Prefault(arena, limit_bytes=bad)  # type: ignore[arg-type]
