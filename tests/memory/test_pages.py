"""The pool's page fitted to the chunk: exact room for whole chunks, one page for a short
last chunk, and a 4 KiB-chunk pool's capacity counted in chunks."""

from __future__ import annotations

import pytest
import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.memory.pages import MAX_PAGE_SIZE, PAGE_ALIGNMENT, page_size_for
from lmcache_async.memory.pool import MemoryObj, MemoryPool

KIB = 1024


@pytest.mark.parametrize(
    ("chunk_bytes", "page"),
    [
        (4 * KIB, 4 * KIB),  # a chunk of up to 64 KiB that is a multiple of 256: itself
        (6 * KIB, 6 * KIB),
        (256, 256),
        (64 * KIB, 64 * KIB),
        (32 << 20, 64 * KIB),  # a real model's chunk: the largest page that divides it
        (96 * KIB, 48 * KIB),
        (100, 256),  # less than the alignment: one aligned page
        (100_000, 5888),  # no divisor: the least spare bytes (96), the largest such page
    ],
)
def test_the_page_is_the_chunk_or_the_largest_page_that_wastes_least(
    chunk_bytes: int, page: int
) -> None:
    assert page_size_for(chunk_bytes) == page


@pytest.mark.parametrize("chunk_bytes", [1, 255, 257, 4000, 4096, 70_000, 1 << 20, 3 * 65536 + 1])
def test_no_allowed_page_wastes_less(chunk_bytes: int) -> None:
    page = page_size_for(chunk_bytes)
    assert page % PAGE_ALIGNMENT == 0 and page <= MAX_PAGE_SIZE
    spare = -chunk_bytes % page
    for other in range(PAGE_ALIGNMENT, MAX_PAGE_SIZE + 1, PAGE_ALIGNMENT):
        assert -chunk_bytes % other > spare or (-chunk_bytes % other == spare and other <= page)


@pytest.mark.parametrize("bad", [0, -4096, 4096.0, True, None])
def test_a_size_that_is_not_a_positive_int_is_refused(bad: object) -> None:
    with pytest.raises(InvalidInputError):
        page_size_for(bad)  # type: ignore[arg-type]


def test_a_pool_of_one_mib_holds_256_chunks_of_4_kib() -> None:
    pool = MemoryPool(1 << 20, page_size=page_size_for(4 * KIB), pin_memory=False)
    objs: list[MemoryObj] = []
    while (obj := pool.allocate_nowait((2, 1, 256, 4), torch.float16)) is not None:
        objs.append(obj)
    assert len(objs) == 256  # capacity / 4 KiB, not 16 pages of 64 KiB
    assert pool.stats().used_bytes == pool.capacity_bytes == 256 * 4 * KIB
    for obj in objs:
        obj.unref()
    assert pool.stats().used_bytes == 0
    assert pool.stats().num_objects == 0


def test_whole_chunks_take_their_bytes_and_a_short_last_chunk_one_page() -> None:
    pool = MemoryPool(8 * 4 * KIB, page_size=page_size_for(4 * KIB), pin_memory=False)
    whole = [pool.allocate_nowait((256, 16), torch.uint8) for _ in range(2)]
    short = pool.allocate_nowait((10, 16), torch.uint8)  # a prompt's last 10 tokens
    assert short is not None and all(obj is not None for obj in whole)
    assert short.nbytes == 160
    assert pool.stats().used_bytes == 3 * 4 * KIB
    assert [obj.offset for obj in [*whole, short] if obj is not None] == [0, 4 * KIB, 8 * KIB]
    for obj in [*whole, short]:
        assert obj is not None
        obj.unref()
    pool.close()
    assert pool.stats().used_bytes == 0
    assert pool.stats().num_objects == 0
