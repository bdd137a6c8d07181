"""Prometheus metrics: the latency tracker, the collector over an embedded engine after
known traffic, the series by tenant and their cap, and the HTTP endpoint scraped over a
real socket."""

from __future__ import annotations

import dataclasses

import anyio
import prometheus_client
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from lmcache_async import CacheEngine, EngineConfig, KVLayout
from lmcache_async.errors import ConfigError, InvalidInputError
from lmcache_async.rpc.metrics import (
    EngineCollector,
    LatencySummary,
    LatencyTracker,
    MetricsServer,
    make_registry,
)
from lmcache_async.stats import EngineStats, TenantStats, TenantUsage
from lmcache_async.tenancy.tenants import tenant_tag

CHUNK = 16
TIMEOUT = 20
LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=2, num_kv_heads=2, head_size=8, block_size=CHUNK, dtype=torch.float16
)


async def http(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send one raw HTTP request to loopback ``port``; the status, headers and body."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(request)
        data = b""
        try:
            while True:
                data += await stream.receive()
        except anyio.EndOfStream:
            pass
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition by (name, sorted labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return found[(name, tuple(sorted(labels.items())))]


# -- latency tracker --------------------------------------------------------------------------


def test_latency_percentiles_and_buckets_are_exact() -> None:
    tracker = LatencyTracker(["lookup", "store"])
    for i in range(1, 101):
        tracker.record("lookup", i / 1000)  # 1 ms .. 100 ms
    summary = tracker.summary("lookup")
    assert summary.sum == pytest.approx(5.05)
    assert summary == LatencySummary(
        count=100, sum=summary.sum, window=100, p50=0.05, p90=0.09, p99=0.099, max=0.1
    )
    assert tracker.summary("store") == LatencySummary(0, 0.0, 0, 0.0, 0.0, 0.0, 0.0)
    buckets, total = tracker.histogram("lookup")
    assert dict(buckets) == {
        "0.0001": 0,
        "0.00025": 0,
        "0.0005": 0,
        "0.001": 1,
        "0.0025": 2,
        "0.005": 5,
        "0.01": 10,
        "0.025": 25,
        "0.05": 50,
        "0.1": 100,
        "0.25": 100,
        "0.5": 100,
        "1.0": 100,
        "2.5": 100,
        "5.0": 100,
        "10.0": 100,
        "+Inf": 100,
    }
    assert buckets[-1][0] == "+Inf"
    assert total == pytest.approx(5.05)


def test_percentiles_cover_the_latest_window_and_totals_everything() -> None:
    tracker = LatencyTracker(["op"], window=10, buckets=[1.0])
    for i in range(20):
        tracker.record("op", float(i))  # 10..19 stay in the window
    summary = tracker.summary("op")
    assert (summary.count, summary.window, summary.sum) == (20, 10, 190.0)
    assert (summary.p50, summary.p99, summary.max) == (14.0, 19.0, 19.0)
    assert tracker.histogram("op")[0] == [("1.0", 2.0), ("+Inf", 20.0)]


def test_time_records_even_when_the_body_raises() -> None:
    tracker = LatencyTracker(["op"])
    with pytest.raises(RuntimeError), tracker.time("op"):
        raise RuntimeError("boom")
    assert tracker.summary("op").count == 1


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"ops": []}, "ops"),
        ({"ops": ["a"], "window": 0}, "window"),
        ({"ops": ["a"], "buckets": [0.1, 0.1]}, "increasing"),
        ({"ops": ["a"], "buckets": [-1.0]}, "positive"),
        ({"ops": ["a"], "buckets": [float("inf")]}, "finite"),
    ],
)
def test_tracker_settings_are_checked(kwargs: dict[str, object], reason: str) -> None:
    with pytest.raises(InvalidInputError, match=reason):
        LatencyTracker(**kwargs)  # type: ignore[arg-type]


def test_unknown_operations_and_bad_durations_are_refused() -> None:
    tracker = LatencyTracker(["op"])
    with pytest.raises(InvalidInputError, match="unknown operation 'other'"):
        tracker.record("other", 0.1)
    with pytest.raises(InvalidInputError, match="seconds"):
        tracker.record("op", -1.0)
    with pytest.raises(InvalidInputError, match="unknown operation"):
        tracker.summary("other")


# -- the collector and the endpoint ------------------------------------------------------------


def _names(registry: CollectorRegistry) -> set[str]:
    return {family.name for family in registry.collect()}


@pytest.mark.anyio
async def test_a_scrape_reports_the_engine_after_known_traffic() -> None:
    tokens = [(i * 31 + 5) % 20_000 for i in range(4 * CHUNK)]
    other = [t + 1 for t in tokens[: 2 * CHUNK]]
    kv = LAYOUT.allocate_kv_caches(4, generator=torch.Generator().manual_seed(3))
    slots = torch.arange(len(tokens))
    config = EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01)
    tracker = LatencyTracker(["lookup", "store"])
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(config, LAYOUT, model_name="metrics") as engine:
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == 64
            with tracker.time("lookup"):
                assert await engine.lookup(tokens) == 64
            assert await engine.lookup(other) == 0
            tracker.record("lookup", 0.003)
            stats = engine.stats()
            collector = EngineCollector(
                engine.stats, latency=tracker, extra=lambda: {"sidecar_sessions": 2}
            )
            registry = make_registry(collector)
            server = await MetricsServer.bind(registry, port=0)
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.serve)
                status, headers, body = await http(
                    server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
                )
                tg.cancel_scope.cancel()
            await server.aclose()
    assert status == 200
    assert headers["content-type"].startswith("text/plain")
    assert int(headers["content-length"]) == len(body)
    found = samples(body.decode())
    assert value(found, "lmcache_async_engine_open") == 1
    assert value(found, "lmcache_async_stored_tokens_total") == 64
    assert value(found, "lmcache_async_lookup_tokens_total") == 96
    assert value(found, "lmcache_async_lookup_hit_tokens_total") == 64
    assert value(found, "lmcache_async_lookup_miss_tokens_total") == 32
    assert value(found, "lmcache_async_requests_total", op="store") == 1
    assert value(found, "lmcache_async_requests_total", op="lookup") == 2
    assert value(found, "lmcache_async_tier_healthy", tier="cpu") == 1
    assert value(found, "lmcache_async_tier_chunks", tier="cpu") == 4
    assert value(found, "lmcache_async_tier_bytes", tier="cpu") == stats.tiers["cpu"].bytes > 0
    assert value(found, "lmcache_async_tier_puts_total", tier="cpu") == stats.tiers["cpu"].puts
    assert value(found, "lmcache_async_cached_chunks") == 4
    assert value(found, "lmcache_async_pool_used_bytes") == stats.pool.used_bytes > 0
    assert value(found, "lmcache_async_pool_capacity_bytes") == stats.pool.capacity_bytes
    assert value(found, "lmcache_async_pool_pinned_bytes") == stats.pool.pinned_bytes == 0
    assert value(found, "lmcache_async_pool_usage_ratio") == pytest.approx(
        stats.pool.used_bytes / stats.pool.capacity_bytes
    )
    assert value(found, "lmcache_async_healthy") == 1
    assert value(found, "lmcache_async_frozen") == 0
    assert value(found, "lmcache_async_request_latency_seconds_count", op="lookup") == 2
    assert (
        value(found, "lmcache_async_request_latency_seconds_bucket", op="lookup", le="0.0025") <= 1
    )
    assert value(found, "lmcache_async_request_latency_seconds_bucket", op="lookup", le="+Inf") == 2
    assert value(found, "lmcache_async_request_latency_seconds_count", op="store") == 0
    assert value(found, "lmcache_async_sidecar_sessions") == 2
    # Its own registry: nothing leaks into the process-wide one.
    assert not any(n.startswith("lmcache_async") for n in _names(prometheus_client.REGISTRY))
    assert server.scrapes == 1


def test_without_an_engine_only_the_server_side_is_reported() -> None:
    tracker = LatencyTracker(["lookup"])
    registry = make_registry(EngineCollector(lambda: None, latency=tracker))
    found = samples(prometheus_client.generate_latest(registry).decode())
    assert value(found, "lmcache_async_engine_open") == 0
    assert value(found, "lmcache_async_request_latency_seconds_count", op="lookup") == 0
    assert not any(name.startswith("lmcache_async_pool") for name, _ in found)


@pytest.mark.anyio
async def test_the_endpoint_answers_only_metrics_requests() -> None:
    registry = make_registry(EngineCollector(lambda: None))
    with anyio.fail_after(TIMEOUT):
        server = await MetricsServer.bind(registry)
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve)
            missing = await http(server.port, b"GET /nope HTTP/1.1\r\n\r\n")
            post = await http(server.port, b"POST /metrics HTTP/1.1\r\n\r\n")
            head = await http(server.port, b"HEAD / HTTP/1.0\r\n\r\n")
            garbage = await http(server.port, b"hello\r\n\r\n")
            huge = await http(server.port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20_000)
            ok = await http(server.port, b"GET /metrics?x=1 HTTP/1.1\r\n\r\n")
            tg.cancel_scope.cancel()
        await server.aclose()
    assert missing[0] == 404
    assert post[0] == 405
    assert head[0] == 200 and head[2] == b"" and int(head[1]["content-length"]) > 0
    assert garbage[0] == 400
    assert huge[0] == 400
    assert ok[0] == 200 and b"lmcache_async_engine_open 0.0" in ok[2]
    assert server.scrapes == 2


@pytest.mark.anyio
async def test_the_endpoint_stays_on_loopback_unless_allowed() -> None:
    registry = make_registry(EngineCollector(lambda: None))
    with pytest.raises(ConfigError, match="metrics_host"):
        await MetricsServer.bind(registry, host="0.0.0.0")
    with pytest.raises(ConfigError, match="metrics_port"):
        await MetricsServer.bind(registry, port=70_000)
    server = await MetricsServer.bind(registry)
    try:
        with pytest.raises(ConfigError, match="cannot listen"):
            await MetricsServer.bind(registry, port=server.port)
    finally:
        await server.aclose()


# -- series by tenant --------------------------------------------------------------------------


def _scrape(collector: EngineCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return samples(prometheus_client.generate_latest(make_registry(collector)).decode())


SECRET_A = "cache-salt-of-team-a-7f3e9b"
"""A tenant's name (vLLM's ``cache_salt``): a secret no scrape may carry."""
SECRET_B = "cache-salt-of-team-b-c41d08"


@pytest.mark.anyio
async def test_tenant_series_follow_each_tenants_lookups_usage_and_erasure() -> None:
    """Series by tenant, under the operator's label for a (``team-a``) and under its tag's
    hex for b, which has no label; neither name appears anywhere in a scrape."""
    tokens = [(i * 31 + 5) % 20_000 for i in range(4 * CHUNK)]
    kv = LAYOUT.allocate_kv_caches(4, generator=torch.Generator().manual_seed(3))
    slots = torch.arange(len(tokens))
    config = EngineConfig(
        chunk_size=CHUNK, max_local_cpu_size=0.01, tenant_labels={SECRET_A: "team-a"}
    )
    a, b = "team-a", tenant_tag(SECRET_B).hex()
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(config, LAYOUT, model_name="metrics") as engine:
            for tenant in (SECRET_A, SECRET_B):
                await engine.store(tokens, kv_caches=kv, slot_mapping=slots, tenant=tenant)
            assert await engine.lookup(tokens, tenant=SECRET_A) == 64
            assert await engine.lookup(tokens[:CHUNK], tenant=SECRET_A) == CHUNK
            assert await engine.lookup([t + 1 for t in tokens], tenant=SECRET_B) == 0
            collector = EngineCollector(engine.stats)
            text = prometheus_client.generate_latest(make_registry(collector)).decode()
            found = samples(text)
            await engine.erase(SECRET_A)
            erased_text = prometheus_client.generate_latest(make_registry(collector)).decode()
            erased = samples(erased_text)
            cpu_bytes = engine.stats().tenants[b].tiers["cpu"].bytes
    for secret in (SECRET_A, SECRET_B):
        assert secret not in text and secret not in erased_text
    assert f'tenant="{a}"' in text and f'tenant="{b}"' in text and len(b) == 32
    prefix = "lmcache_async_tenant_"
    assert value(found, prefix + "lookups_total", tenant=a) == 2
    assert value(found, prefix + "lookup_tokens_total", tenant=a) == 80
    assert value(found, prefix + "lookup_hit_tokens_total", tenant=a) == 80
    assert value(found, prefix + "lookups_total", tenant=b) == 1
    assert value(found, prefix + "lookup_hit_tokens_total", tenant=b) == 0
    for tenant in (a, b):
        assert value(found, prefix + "chunks", tenant=tenant, tier="cpu") == 4
        assert value(found, prefix + "bytes", tenant=tenant, tier="cpu") == cpu_bytes > 0
        assert value(found, prefix + "erased_total", tenant=tenant, tier="cpu") == 0
    assert value(erased, prefix + "chunks", tenant=a, tier="cpu") == 0
    assert value(erased, prefix + "erased_total", tenant=a, tier="cpu") == 4
    assert value(erased, prefix + "chunks", tenant=b, tier="cpu") == 4
    assert not any(name == prefix + "quota_bytes" for name, _ in found), "no quotas here"


@pytest.mark.anyio
async def test_at_most_the_cap_of_tenants_get_a_label_the_rest_are_summed_as_other() -> None:
    config = EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01)
    async with CacheEngine.open(config, LAYOUT, model_name="metrics") as engine:
        base = engine.stats()

    def with_tenants(*names: str) -> EngineStats:
        figures = {
            name: TenantStats(
                tag=f"{i:08x}",
                lookup_requests=1,
                lookup_tokens=10 * (i + 1),
                tiers={"cpu": TenantUsage(chunks=i + 1, bytes=100, quota_bytes=1000)},
            )
            for i, name in enumerate(names)
        }
        return dataclasses.replace(base, tenants=figures)

    current = with_tenants("t0", "t1", "t2", "t3")
    collector = EngineCollector(lambda: current, tenant_labels=2)
    found = _scrape(collector)
    lookups = {
        dict(labels)["tenant"]: v
        for (name, labels), v in found.items()
        if name == "lmcache_async_tenant_lookups_total"
    }
    assert lookups == {"t0": 1, "t1": 1, "other": 2}
    assert value(found, "lmcache_async_tenant_lookup_tokens_total", tenant="other") == 30 + 40
    assert value(found, "lmcache_async_tenant_chunks", tenant="other", tier="cpu") == 3 + 4
    assert value(found, "lmcache_async_tenant_quota_bytes", tenant="other", tier="cpu") == 2000
    # The labelled tenants keep their labels: one that sorts first does not take one.
    current = with_tenants("a0", "t0", "t1")
    again = _scrape(collector)
    labelled = {
        dict(labels)["tenant"]
        for (name, labels), _ in again.items()
        if name == "lmcache_async_tenant_lookups_total"
    }
    assert labelled == {"t0", "t1", "other"}
    assert value(again, "lmcache_async_tenant_lookups_total", tenant="other") == 1
    with pytest.raises(InvalidInputError, match="cap"):
        EngineCollector(lambda: None, tenant_labels=-1)
