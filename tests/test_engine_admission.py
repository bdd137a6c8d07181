"""Store admission (``store_threshold``) through the engine, over a real disk tier and a
real Redis: a chunk seen once stays in the CPU tier only, the lookup that sees it again
writes it behind, and a restart (or another engine) then finds it there. Threshold 1 is
today's behaviour; a CPU tier that cannot hold a chunk back lets it through. Every
retrieve is checked bit for bit."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import redis

from lmcache_async import CacheEngine
from lmcache_async.stats import AdmissionStats
from tests.servers import RedisServer
from tests.test_engine_redis import open_engine, retrieve_checked
from tests.test_engine_redis import store as store_redis
from tests.test_engine_tiers import (
    TIMEOUT,
    chunk_files,
    engine_on,
    retrieve,
    store,
    tokens_of,
)


@pytest.mark.anyio
async def test_a_chunk_seen_once_stays_off_the_disk_until_seen_again(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path, store_threshold=2) as engine:
            assert await store(engine, 100) == 100  # 7 chunks, one sighting each
            assert chunk_files(tmp_path) == []
            stats = engine.stats()
            assert stats.tiers["cpu"].chunks == 7
            assert stats.tiers["disk"].chunks == 0
            assert stats.admission == AdmissionStats(
                threshold=2,
                tracked_chunks=7,
                capacity=stats.admission.capacity,
                admitted_chunks=0,
                held_back_chunks=7,
                written_behind_chunks=0,
            )
            # A lookup is the second sighting: the chunks are written behind.
            assert await engine.lookup(tokens_of(100, 1)) == 100
            assert await engine.flush()
            assert len(chunk_files(tmp_path)) == 7
            assert engine.stats().admission.written_behind_chunks == 7
            # A third sighting writes nothing again.
            assert await engine.lookup(tokens_of(100, 1)) == 100
            assert await engine.flush()
            assert engine.stats().admission.written_behind_chunks == 7
            assert engine.stats().tiers["disk"].puts == 7
        async with engine_on(tmp_path, store_threshold=2) as engine:
            assert engine.stats().tiers["cpu"].chunks == 0
            assert await engine.lookup(tokens_of(100, 1)) == 100
            await retrieve(engine, 100, 100)


@pytest.mark.anyio
async def test_a_lookup_before_the_store_counts_and_the_store_does_not(tmp_path: Path) -> None:
    """The serving engine's order: a lookup misses, the prompt is computed and stored,
    the next request's lookup is the second sighting."""
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path, store_threshold=2) as engine:
            assert await engine.lookup(tokens_of(64, 1)) == 0
            assert await store(engine, 64) == 64
            assert chunk_files(tmp_path) == []
            assert await store(engine, 64) == 64  # stored again: no new sighting
            assert chunk_files(tmp_path) == []
            assert await engine.lookup(tokens_of(64, 1)) == 64
            assert await engine.flush()
            assert len(chunk_files(tmp_path)) == 4


@pytest.mark.anyio
async def test_only_the_chunks_seen_enough_are_written(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path, store_threshold=3) as engine:
            for _ in range(3):  # the first two chunks: three sightings
                assert await engine.lookup(tokens_of(32, 1)) == 0
            assert await store(engine, 64) == 64  # those two admitted, two held back
            files = chunk_files(tmp_path)
            spans = engine.key_hasher.spans(tokens_of(64, 1))
            assert sorted(p.name.split(".")[0] for p in files) == sorted(
                span.key.to_str() for span in spans[:2]
            )
            admission = engine.stats().admission
            assert (admission.admitted_chunks, admission.held_back_chunks) == (2, 2)
            assert await engine.lookup(tokens_of(64, 1)) == 64  # the last two: twice
            assert await engine.flush()
            assert len(chunk_files(tmp_path)) == 2
            assert await engine.lookup(tokens_of(64, 1)) == 64  # three times
            assert await engine.flush()
            assert len(chunk_files(tmp_path)) == 4
            await engine.clear(locations=["cpu"])
            await retrieve(engine, 64, 64)  # from disk


@pytest.mark.anyio
async def test_a_chunk_evicted_before_its_second_sighting_is_not_written(
    tmp_path: Path,
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path, store_threshold=2) as engine:
            assert await store(engine, 48) == 48
            assert await engine.clear(locations=["cpu"]) == 3
            assert await engine.lookup(tokens_of(48, 1)) == 0
            assert await engine.flush()
            assert chunk_files(tmp_path) == []
            assert engine.stats().admission.written_behind_chunks == 0


@pytest.mark.anyio
async def test_threshold_one_writes_every_chunk_at_once(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            assert await store(engine, 100) == 100
            assert len(chunk_files(tmp_path)) == 7
            assert engine._parts.manager._admission is None  # nothing is counted
            assert engine.stats().admission == AdmissionStats()


@pytest.mark.anyio
async def test_a_store_the_cpu_tier_does_not_keep_goes_to_disk_at_once(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path, store_threshold=2, local_cpu=False) as engine:
            assert await store(engine, 50) == 50
            assert len(chunk_files(tmp_path)) == 4
            assert engine.stats().admission.held_back_chunks == 0
        async with engine_on(tmp_path, store_threshold=2, store_location=["disk"]) as engine:
            assert await store(engine, 50, seed=2) == 50
            assert len(chunk_files(tmp_path)) == 8


@pytest.mark.anyio
async def test_held_back_chunks_reach_redis_when_seen_again(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    before = set(client.keys("*"))
    try:
        with anyio.fail_after(TIMEOUT):
            first: CacheEngine
            async with open_engine(redis_server.url, store_threshold=2) as first:
                assert await store_redis(first, 90, 6) == 90
                assert await first.flush()
                assert set(client.keys("*")) == before  # held back
                assert first.stats().tiers["redis"].chunks == 0
                assert await first.lookup(tokens_of(90, 6)) == 90
                assert await first.flush()
                assert len(set(client.keys("*")) - before) == 6
                assert first.stats().admission.written_behind_chunks == 6
            async with open_engine(redis_server.url, store_threshold=2) as second:
                assert await second.lookup(tokens_of(90, 6)) == 90
                await retrieve_checked(second, 90, 6, 90)
    finally:
        client.close()
