"""The load-or-recompute model inside an engine: the start probe seeds a real Redis tier's
speed and leaves nothing behind, the disk tier is measured by its real reads, and the
figures appear in ``stats()``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import redis

from lmcache_async import Promise
from lmcache_async.backends.cpu import CPUBackend
from lmcache_async.engine.costs import LoadCosts
from lmcache_async.engine.probe import PROBE_TAG, TierProbe, probe_key
from lmcache_async.errors import TierError
from lmcache_async.memory.pool import MemoryPool
from lmcache_async.tenancy.tenants import TAG_BYTES, tenant_tag
from tests.servers import RedisServer
from tests.test_engine_redis import open_engine, retrieve_checked
from tests.test_engine_redis import store as store_redis
from tests.test_engine_tiers import TIMEOUT, engine_on, layout, retrieve, store, tokens_of


@pytest.mark.anyio
async def test_the_start_probe_measures_redis_and_leaves_nothing(
    redis_server: RedisServer,
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    before = set(client.keys("*"))
    try:
        with anyio.fail_after(TIMEOUT):
            async with open_engine(redis_server.url) as engine:
                probe: TierProbe = engine._parts.probe
                await probe.wait()
                assert probe.probed == ["redis"]
                speed = engine.stats().load_costs.tiers["redis"]
                assert speed.samples == 2
                assert speed.latency_s is not None and speed.latency_s > 0
                assert speed.throughput_bytes_per_s is not None
                assert speed.throughput_bytes_per_s > 0
                assert set(client.keys("*")) == before
                redis_stats = engine.stats().tiers["redis"]
                assert redis_stats.chunks == 0
                assert redis_stats.puts == 1  # the probe's chunk, counted by the tier
                # The reads that follow keep measuring.
                assert await store_redis(engine, 64, 7) == 64
                assert await engine.flush()
                await engine.clear(locations=["cpu"])
                await retrieve_checked(engine, 64, 7, 64)
                assert engine.stats().load_costs.tiers["redis"].samples > 2
    finally:
        client.close()


@pytest.mark.anyio
async def test_an_unreachable_redis_is_not_probed_and_fails_nothing(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with open_engine("redis://127.0.0.1:1", remote_timeout=0.2) as engine:
            await engine._parts.probe.wait()
            assert engine._parts.probe.probed == []
            assert engine.stats().load_costs.tiers["redis"].samples == 0


@pytest.mark.anyio
async def test_the_disk_tier_is_measured_by_its_reads_not_probed(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            await engine._parts.probe.wait()
            assert engine._parts.probe.probed == []
            assert await store(engine, 64) == 64
            assert engine.stats().load_costs.tiers["disk"].samples == 0
        async with engine_on(tmp_path) as engine:
            await retrieve(engine, 64, 64)
            costs = engine.stats().load_costs
            assert costs.tiers["disk"].samples >= 1
            assert costs.tiers["disk"].throughput_bytes_per_s is not None
            assert costs.decisions == 0  # only promises decide
            assert "cpu" not in costs.tiers


@pytest.mark.anyio
async def test_a_probe_stopped_before_it_ran_does_nothing(redis_server: RedisServer) -> None:
    with anyio.fail_after(TIMEOUT):
        async with open_engine(redis_server.url) as engine:
            probe = engine._parts.probe
            await probe.wait()
        # Closed: stopping again returns at once and the probe would not run.
        await probe.stop()
        await probe.run()
        assert probe.probed == ["redis"]


class FarTier(CPUBackend):
    """A tier in host memory that the probe takes for a far one; ``fail`` makes puts
    fail."""

    name = "far"

    def __init__(self, pool: MemoryPool, *, fail: bool = False) -> None:
        super().__init__(pool)
        self.fail = fail

    async def put(self, keys: Any, objs: Any, *, spec: Any = None) -> int:
        if self.fail:
            raise TierError("disk full")
        return await super().put(keys, objs)


@pytest.mark.anyio
@pytest.mark.parametrize("fail", [False, True])
async def test_the_probe_seeds_a_tier_or_logs_its_failure(fail: bool) -> None:
    pool = MemoryPool(1 << 20)
    tier = FarTier(pool, fail=fail)
    costs = LoadCosts(["cpu", "far"], chunk_size=16)
    probe = TierProbe(costs, pool, layout(), lambda: [tier], chunk_size=16)
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(probe.run)
            await probe.wait()
            await probe.stop()
    assert probe.probed == ([] if fail else ["far"])
    assert costs.stats().tiers["far"].samples == (0 if fail else 2)
    assert len(tier) == 0  # the probe's chunk was removed
    assert pool.stats().num_objects == 0
    pool.close()


@pytest.mark.anyio
async def test_a_declined_tier_is_probed_again_at_most_once_an_interval() -> None:
    pool = MemoryPool(1 << 20)
    tier = FarTier(pool)
    costs = LoadCosts(["cpu", "far"], chunk_size=16)
    now = [0.0]
    probe = TierProbe(costs, pool, layout(), lambda: [tier], chunk_size=16, clock=lambda: now[0])
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(probe.run)
            await probe.wait()
            assert probe.probed == ["far"]
            now[0] = 10.0
            assert not probe.want("far")  # probed 10 s ago: its figures are fresh
            assert not probe.want("disk")  # never probed (the page cache would answer)
            now[0] = 31.0
            assert probe.want("far")
            assert not probe.want("far")  # asked already: once an interval
            with anyio.fail_after(TIMEOUT):
                while len(probe.probed) < 2:
                    await anyio.wait_all_tasks_blocked()
            await probe.stop()
    assert probe.probed == ["far", "far"]
    assert costs.stats().tiers["far"].samples == 4
    assert len(tier) == 0
    assert pool.stats().num_objects == 0
    pool.close()


def test_probe_keys_carry_their_own_tag_and_never_repeat() -> None:
    keys = {probe_key() for _ in range(100)}
    assert len(keys) == 100
    assert all(key[:TAG_BYTES] == PROBE_TAG for key in keys)
    assert tenant_tag(None) != PROBE_TAG
    assert all(key.layer is None for key in keys)


@pytest.mark.anyio
async def test_promises_decline_what_is_cheaper_to_recompute(redis_server: RedisServer) -> None:
    """Redis measured by the probe: against a prefill that is all but free nothing there is
    worth loading; against a slow one all of it is."""
    with anyio.fail_after(TIMEOUT):
        async with open_engine(redis_server.url) as engine:
            assert engine._parts.probe.probed == ["redis"]
            assert await store_redis(engine, 64, 8) == 64
            assert await engine.flush()
            await engine.clear(locations=["cpu"])
            prompt = tokens_of(64, 8)
            fast = await engine.promise(prompt, lookup_id="fast", prefill_tokens_per_s=1e12)
            assert fast == Promise(0, False)
            costs = engine.stats().load_costs
            assert dict(costs.declined_tokens) == {"redis": 64}
            assert costs.prefill_tokens_per_s == 1e12
            slow = await engine.promise(prompt, lookup_id="slow", prefill_tokens_per_s=1.0)
            while slow.pending:
                prefetch = engine._parts.core.load.prefetching("slow")
                assert prefetch is not None
                await prefetch.done.wait()
                slow = await engine.promise(prompt, lookup_id="slow", prefill_tokens_per_s=1.0)
            assert slow == Promise(64, False)
            costs = engine.stats().load_costs
            assert (costs.decisions, costs.cut_decisions) == (2, 1)
            assert dict(costs.promised_tokens) == {"redis": 64}
            await retrieve_checked(engine, 64, 8, 64)
