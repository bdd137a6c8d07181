"""What a chunk costs the CPU tier beyond its payload (``measure_cpu_tier``): its pages
are exactly its bytes, and the rest is its key, its index entry and its payload object
(no tensor, no second map of keys); with events on, also the token ids its stores' events
must carry."""

from __future__ import annotations

import pytest

from lmcache_async.backends.footprint import measure_cpu_tier

pytestmark = pytest.mark.anyio

CHUNKS = 1000
TOKEN_IDS = 256 * 4  # a chunk's 256 token ids as int32


async def test_a_4_kib_chunk_takes_its_bytes_and_a_few_hundred_more() -> None:
    got = await measure_cpu_tier(CHUNKS, chunk_tokens=256, token_bytes=16, events=False)
    assert (got.chunks, got.chunk_bytes, got.pool_bytes_per_chunk) == (CHUNKS, 4096, 4096)
    # A tensor view per chunk (~700 bytes, most unseen here) or a second ordered map of
    # the keys would take it past this.
    assert 0 < got.overhead_bytes_per_chunk < 384


async def test_with_events_a_chunk_holds_its_token_ids_once() -> None:
    got = await measure_cpu_tier(CHUNKS, chunk_tokens=256, token_bytes=16, events=True)
    assert got.events and got.pool_bytes_per_chunk == 4096
    assert TOKEN_IDS < got.overhead_bytes_per_chunk < TOKEN_IDS + 384


async def test_counts_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        await measure_cpu_tier(0)
