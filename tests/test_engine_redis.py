"""CacheEngine over a real Redis: a second engine (another "host") hits what the first
stored, through a standalone server and a 3-node cluster; a truncated value is a miss; and
Redis stopped under load fails no request, is reported down, and is used again when it
is back."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
import torch

from lmcache_async import CacheEngine, EngineConfig
from tests.servers import RedisCluster, RedisServer
from tests.test_engine_tiers import (
    CHUNK,
    assert_loaded_exactly,
    layout,
    slots_of,
    source_caches,
    tokens_of,
)

TIMEOUT = 60


def redis_config(url: str, **overrides: Any) -> EngineConfig:
    values: dict[str, Any] = {
        "chunk_size": CHUNK,
        "max_local_cpu_size": 0.01,
        "remote_url": url,
        "remote_timeout": 0.5,
        "health_check_interval": 0.1,
    }
    values.update(overrides)
    return EngineConfig(**values)


@asynccontextmanager
async def open_engine(url: str, **overrides: Any) -> AsyncIterator[CacheEngine]:
    """An engine over Redis, its start probe done (so its chunk is not counted)."""
    async with CacheEngine.open(
        redis_config(url, **overrides), layout(), model_name="redis-test"
    ) as engine:
        await engine._parts.probe.wait()
        yield engine


async def store(engine: CacheEngine, n: int, seed: int) -> int:
    return await engine.store(
        tokens_of(n, seed), kv_caches=source_caches(seed), slot_mapping=slots_of(n, seed)
    )


async def retrieve_checked(engine: CacheEngine, n: int, seed: int, expected: int) -> None:
    target = [torch.zeros_like(t) for t in source_caches(seed)]
    slots = slots_of(n, seed)
    mask = await engine.retrieve(tokens_of(n, seed), kv_caches=target, slot_mapping=slots)
    assert_loaded_exactly(source_caches(seed), target, slots, mask, expected)


@pytest.mark.anyio
async def test_another_engine_hits_through_standalone_redis(redis_server: RedisServer) -> None:
    with anyio.fail_after(TIMEOUT):
        async with open_engine(redis_server.url) as first:
            assert await store(first, 90, 3) == 90
            assert await first.flush()
            assert first.stats().tiers["redis"].chunks >= 6
        async with open_engine(redis_server.url, tier_codec="lz4") as second:
            assert await second.lookup(tokens_of(90, 3)) == 90
            await retrieve_checked(second, 90, 3, 90)
            assert second.stats().promoted_chunks == 6


@pytest.mark.anyio
async def test_sender_and_receiver_share_redis(redis_server: RedisServer) -> None:
    """Disaggregated prefill over a shared Redis: the sender writes Redis only; the
    receiver loads from it bit-exact and removes what it loaded."""
    client = redis.Redis.from_url(redis_server.url)
    before = set(client.keys("*"))  # the server may be shared with other tests
    with anyio.fail_after(TIMEOUT):
        async with open_engine(
            redis_server.url, store_location=["redis"], wait_for_slow_tiers=True
        ) as sender:
            assert await store(sender, 90, 5) == 90
            assert sender.stats().tiers["cpu"].chunks == 0
            assert sender.stats().tiers["redis"].chunks == 6
        async with open_engine(
            redis_server.url,
            retrieve_locations=["redis"],
            remove_after_retrieve=True,
            local_cpu=False,
        ) as receiver:
            assert await receiver.lookup(tokens_of(90, 5)) == 90
            await retrieve_checked(receiver, 90, 5, 90)
            assert await receiver.lookup(tokens_of(90, 5)) == 0
    try:
        assert set(client.keys("*")) == before
    finally:
        client.close()


@pytest.mark.anyio
@pytest.mark.slow
async def test_another_engine_hits_through_a_redis_cluster(redis_cluster: RedisCluster) -> None:
    with anyio.fail_after(TIMEOUT):
        async with open_engine(redis_cluster.url, remote_timeout=3.0) as first:
            assert await store(first, 128, 4) == 128
            assert await first.flush()
            assert first.stats().tiers["redis"].chunks == 8
        async with open_engine(redis_cluster.url, remote_timeout=3.0) as second:
            await retrieve_checked(second, 128, 4, 128)


@pytest.mark.anyio
async def test_truncated_value_is_a_miss(redis_server: RedisServer) -> None:
    with anyio.fail_after(TIMEOUT):
        async with open_engine(redis_server.url) as first:
            await store(first, 64, 5)
            assert await first.flush()
            key = first.key_hasher.spans(tokens_of(64, 5))[1].key
        raw = redis.Redis.from_url(redis_server.url)
        try:
            names = [n for n in raw.keys("*") if key.to_str().encode() in n]
            assert len(names) == 1
            value = raw.get(names[0])
            assert isinstance(value, bytes)
            raw.set(names[0], value[: len(value) // 2])
            async with open_engine(redis_server.url) as second:
                await retrieve_checked(second, 64, 5, CHUNK)
                assert second.stats().tiers["redis"].corrupt == 1
            assert raw.exists(names[0]) == 0
        finally:
            raw.close()


@pytest.mark.anyio
@pytest.mark.slow
async def test_redis_stopped_under_load_fails_no_request(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Clients keep storing and retrieving while Redis goes away and comes back."""
    errors: list[BaseException] = []
    counter = itertools.count(100)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(redis_server.url, local_disk=str(tmp_path)) as engine:

            async def client() -> None:
                for _ in range(4):
                    seed = next(counter)
                    try:
                        assert await store(engine, 48, seed) == 48
                        await retrieve_checked(engine, 48, seed, 48)
                    except BaseException as exc:
                        errors.append(exc)
                        raise

            async def phase() -> None:
                async with anyio.create_task_group() as tg:
                    for _ in range(3):
                        tg.start_soon(client)

            await phase()
            assert engine.stats().tier_health["redis"]
            redis_server.stop()
            await phase()  # calls fail fast and mark the tier down
            assert await engine.check_health() == {"cpu": True, "disk": True, "redis": False}
            await phase()
            stats = engine.stats()
            assert stats.failed_requests == 0
            assert stats.tier_health == {"cpu": True, "disk": True, "redis": False}
            redis_server.restart()
            assert await engine.check_health() == {"cpu": True, "disk": True, "redis": True}
            # Stores reach Redis again, and what is there is hit again.
            assert await store(engine, 64, 999) == 64
            assert await engine.flush()
            raw = redis.Redis.from_url(redis_server.url)
            try:
                assert raw.dbsize() >= 4
            finally:
                raw.close()
            await engine.clear(locations=["cpu", "disk"])
            assert await engine.lookup(tokens_of(64, 999)) == 64
            await retrieve_checked(engine, 64, 999, 64)
    assert errors == []


@pytest.mark.anyio
async def test_concurrent_retrieves_of_a_redis_only_prefix_get_each_chunk_once(
    redis_server: RedisServer,
) -> None:
    # Eight requests for one prefix held only in Redis, at once: each chunk is fetched
    # (on the tier's bulk path) once, and every request loads it all, bit-exact.
    with anyio.fail_after(TIMEOUT):
        async with open_engine(
            redis_server.url, store_location=["redis"], wait_for_slow_tiers=True
        ) as sender:
            assert await store(sender, 90, 6) == 90
        async with open_engine(redis_server.url) as receiver:
            redis_server.command("CONFIG", "RESETSTAT")
            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(retrieve_checked, receiver, 90, 6, 90)
    stats = redis_server.command("INFO", "commandstats").decode()
    gets = [line for line in stats.splitlines() if line.startswith("cmdstat_get:")]
    assert gets and "calls=6," in gets[0], gets
