"""The disk tier's index: small entries (interned shapes, shared ints), what a read may
settle, the fill's merges (skips, order, a key named twice counted once), trimming to the
capacity."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

import pytest
from structlog.testing import capture_logs

from lmcache_async.backends.disk_file import ReadStatus
from lmcache_async.backends.disk_index import DiskIndex
from lmcache_async.keys.chunks import DIGEST_SIZE, ChunkKey
from lmcache_async.tenancy.tenants import TAG_BYTES, tenant_tag

SHAPE = (2, 16, 2, 2, 8)
SIZE = 4283
TAG = tenant_tag(None)
MEASURED_BEFORE = 515
"""Bytes per chunk the index held before its entries were trimmed (tracemalloc, 100k
chunks, a fill at open): each entry a dataclass with its own shape tuple and size int,
and the tenants' ledger a second dictionary of every key."""


def key(i: int, tag: bytes = TAG) -> ChunkKey:
    return ChunkKey(tag + i.to_bytes(DIGEST_SIZE - TAG_BYTES, "little"))


def fill(index: DiskIndex, keys: list[bytes]) -> None:
    """As the fill merges a manifest's entries, a batch at a time."""
    index.begin_fill()
    for start in range(0, len(keys), 8192):
        batch = keys[start : start + 8192]
        index.merge(
            batch, [SIZE] * len(batch), [0] * len(batch), [SHAPE], since=index.ledger.erasures
        )
    index.end_fill()


def add(index: DiskIndex, keys: list[bytes]) -> None:
    """As puts index what they wrote (each shape a fresh tuple, as a header gives it)."""
    for k in keys:
        index.add(k, SIZE, tuple(int(dim) for dim in SHAPE))


@pytest.mark.parametrize("how", [fill, add], ids=["fill", "puts"])
def test_an_entry_costs_less_than_half_what_it_did(how: Callable[..., None]) -> None:
    n = 100_000
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        keys: list[bytes] = [key(i) for i in range(n)]  # as a put's request holds them
        if how is fill:
            keys = [bytes(k) for k in keys]  # as a manifest gives them
        index = DiskIndex(1 << 50)
        how(index, keys)
        del keys
        gc.collect()
        per_chunk = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert len(index) == n and index.bytes == n * SIZE
    assert per_chunk < MEASURED_BEFORE / 2
    assert index.footprint() / n == pytest.approx(per_chunk, rel=0.25)
    assert len(index.shapes.shapes) == 1  # one tuple for every full chunk


def test_a_read_settles_only_the_entry_it_began_with() -> None:
    index = DiskIndex(1 << 30)
    first = index.add(key(1), SIZE, SHAPE)
    index.pop(key(1))
    second = index.add(key(1), SIZE, SHAPE)  # the same size and shape, written again
    assert first != second
    assert not index.settle(key(1), first, ReadStatus.MISSING)  # the old file's outcome
    assert key(1) in index and index.bytes == SIZE
    assert index.settle(key(1), second, ReadStatus.CORRUPT)
    assert key(1) not in index and index.bytes == 0


def test_merges_skip_what_was_put_dropped_or_erased_meanwhile() -> None:
    index = DiskIndex(1 << 30)
    index.begin_fill()
    since = index.ledger.erasures
    index.add(key(1), SIZE + 1, SHAPE)  # a put was first: its entry is the newer
    index.add(key(2), SIZE, SHAPE)
    index.pop(key(2))  # dropped while filling
    other = tenant_tag("other")
    index.ledger.mark_erased(other)  # the tenant was erased after the listing
    keys = [key(1), key(2), key(3), key(4, other)]
    assert index.merge(keys, [SIZE] * 4, [0] * 4, [SHAPE], since=since) == 1
    assert index.size_of(index.get(key(1)) or 0) == SIZE + 1
    assert key(2) not in index and key(3) in index and key(4, other) not in index
    assert index.bytes == 2 * SIZE + 1
    assert index.ledger.usage()[TAG.hex()].chunks == 2


def test_what_is_used_while_filling_ends_up_the_most_recent() -> None:
    index = DiskIndex(1 << 30)
    index.begin_fill()
    since = index.ledger.erasures
    index.merge([key(0), key(1)], [SIZE] * 2, [0, 0], [SHAPE], since=since)
    index.add(key(10), SIZE, SHAPE)  # a put while filling
    assert index.held_prefix([key(0)]) == 1  # a hit while filling
    index.merge([key(2), key(3)], [SIZE] * 2, [0, 0], [SHAPE], since=since)
    index.end_fill()
    assert list(index) == [key(1), key(2), key(3), key(10), key(0)]
    assert not index.filling


def test_trim_evicts_the_oldest_beyond_the_capacity() -> None:
    index = DiskIndex(3 * SIZE)
    index.begin_fill()
    index.merge([key(i) for i in range(5)], [SIZE] * 5, [0] * 5, [SHAPE], since=0)
    index.end_fill()
    assert index.trim() == [key(0), key(1)]
    assert (len(index), index.bytes, index.evictions) == (3, 3 * SIZE, 2)
    assert index.trim() == []


def test_a_lookup_naming_a_key_twice_indexes_and_counts_it_once() -> None:
    index = DiskIndex(1 << 30)
    index.begin_fill()
    since = index.ledger.erasures
    keys = [key(1), key(2), key(1)]  # a get of the same chunk twice while the index fills
    assert index.merge(keys, [SIZE, SIZE, SIZE + 1], [0] * 3, [SHAPE], since=since, used=True) == 2
    assert index.bytes == 2 * SIZE and index.size_of(index.get(key(1)) or 0) == SIZE
    assert index.ledger.usage()[TAG.hex()].chunks == 2
    assert index.ledger.usage()[TAG.hex()].bytes == 2 * SIZE


def test_a_key_the_fill_names_twice_is_counted_once() -> None:
    """Never expected (the manifest's keys are checked distinct, a listing names each file
    once): should a fill's batch name a key twice, the accounts are rebuilt from the
    entries."""
    index = DiskIndex(1 << 30)
    index.begin_fill()
    other = tenant_tag("other")
    index.merge([key(1)], [SIZE], [0], [SHAPE], since=0)
    keys = [key(2), key(3, other), key(2)]
    with capture_logs() as logs:
        assert index.merge(keys, [SIZE, SIZE, SIZE + 5], [0] * 3, [SHAPE], since=0) == 2
    assert [e["event"] for e in logs] == ["disk_index_key_found_twice"]
    assert list(index) == [key(1), key(2), key(3, other)]  # 2 in its first place
    assert index.size_of(index.get(key(2)) or 0) == SIZE + 5  # as last named
    assert index.bytes == 3 * SIZE + 5
    usage = index.ledger.usage()
    assert (usage[TAG.hex()].chunks, usage[TAG.hex()].bytes) == (2, 2 * SIZE + 5)
    assert (usage[other.hex()].chunks, usage[other.hex()].bytes) == (1, SIZE)
    index.end_fill()
