"""Prometheus series of the load-or-recompute model and of store admission: an engine over
a disk tier with ``store_threshold`` 2 after known traffic, and decisions counted by a
model with given tier speeds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import anyio
import prometheus_client
import pytest

from lmcache_async.engine.costs import LoadCosts, Run
from lmcache_async.rpc.metrics import EngineCollector, make_registry
from tests.rpc.test_metrics import samples, value
from tests.test_engine_tiers import TIMEOUT, engine_on, retrieve, store, tokens_of

CHUNK = 16


def scrape(collector: EngineCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return samples(prometheus_client.generate_latest(make_registry(collector)).decode())


@pytest.mark.anyio
async def test_admission_and_tier_reads_are_reported(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path, store_threshold=2) as engine:
            assert await store(engine, 64) == 64  # 4 chunks held back
            assert await engine.lookup(tokens_of(64, 1)) == 64  # written behind
            assert await engine.flush()
            await engine.clear(locations=["cpu"])
            await retrieve(engine, 64, 64)  # read from disk: measured
            stats = engine.stats()
            found = scrape(EngineCollector(engine.stats))
    assert value(found, "lmcache_async_admission_threshold") == 2
    assert value(found, "lmcache_async_admission_tracked_chunks") == 4
    assert value(found, "lmcache_async_admission_held_back_chunks_total") == 4
    assert value(found, "lmcache_async_admission_written_behind_chunks_total") == 4
    assert value(found, "lmcache_async_admission_admitted_chunks_total") == 0
    disk = stats.load_costs.tiers["disk"]
    assert disk.samples >= 1
    assert value(found, "lmcache_async_tier_read_samples_total", tier="disk") == disk.samples
    assert value(
        found, "lmcache_async_tier_read_throughput_bytes_per_second", tier="disk"
    ) == pytest.approx(disk.throughput_bytes_per_s)
    assert value(found, "lmcache_async_tier_read_latency_seconds", tier="disk") == pytest.approx(
        disk.latency_s
    )
    assert value(found, "lmcache_async_load_decisions_total") == 0
    assert not any(name == "lmcache_async_prefill_tokens_per_second" for name, _ in found)


@pytest.mark.anyio
async def test_decisions_are_reported_by_tier(tmp_path: Path) -> None:
    model = LoadCosts(["cpu", "disk", "redis"], chunk_size=CHUNK)
    model.observe("redis", 0, 0.001)
    model.observe("redis", 1 << 20, 0.001 + (1 << 20) / 1e6)  # 1 MB/s
    runs = [Run("cpu", 2 * CHUNK, 2 * CHUNK * 1024), Run("redis", 4 * CHUNK, 4 * CHUNK * 1024)]
    model.record(
        model.decide(runs, computed_tokens=0, total_tokens=6 * CHUNK, prefill_tokens_per_s=1e4)
    )
    model.record(model.decide(runs, computed_tokens=0, total_tokens=6 * CHUNK))
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            stats = dataclasses.replace(engine.stats(), load_costs=model.stats())
    found = scrape(EngineCollector(lambda: stats))
    assert value(found, "lmcache_async_load_decisions_total") == 2
    assert value(found, "lmcache_async_load_cut_decisions_total") == 1
    assert value(found, "lmcache_async_load_promised_tokens_total", tier="cpu") == 4 * CHUNK
    assert value(found, "lmcache_async_load_promised_tokens_total", tier="redis") == 4 * CHUNK
    assert value(found, "lmcache_async_load_declined_tokens_total", tier="redis") == 4 * CHUNK
    assert value(found, "lmcache_async_tier_read_samples_total", tier="redis") == 2
    assert value(
        found, "lmcache_async_tier_read_throughput_bytes_per_second", tier="redis"
    ) == pytest.approx(1e6)
    assert value(found, "lmcache_async_tier_read_samples_total", tier="disk") == 0
    # Not measured: no speed reported for it.
    assert not any(
        name == "lmcache_async_tier_read_latency_seconds" and labels == (("tier", "disk"),)
        for name, labels in found
    )
    # The last decision had no prefill speed: none is reported.
    assert not any(name == "lmcache_async_prefill_tokens_per_second" for name, _ in found)
    model.record(
        model.decide(runs, computed_tokens=0, total_tokens=6 * CHUNK, prefill_tokens_per_s=2e4)
    )
    stats = dataclasses.replace(stats, load_costs=model.stats())
    assert (
        value(scrape(EngineCollector(lambda: stats)), "lmcache_async_prefill_tokens_per_second")
        == 2e4
    )
