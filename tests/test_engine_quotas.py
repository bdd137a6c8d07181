"""Tenant quotas through the engine, in each tier: a tenant that writes ten times its
quota evicts only its own chunks, and another tenant's prompts, within their quota, stay
whole hits; a tenant named in the quotas is never evicted to make room for another. The
same holds for disk writes made behind the stores, and for chunks a retrieve promotes from
disk into the CPU tier."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import prometheus_client
import pytest
import torch

from lmcache_async import CacheEngine
from lmcache_async.backends.disk import DiskBackend
from lmcache_async.config import GB
from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.memory.pool import MemoryObj, page_size_for
from lmcache_async.rpc.metrics import EngineCollector, make_registry
from lmcache_async.tenancy.tenants import tenant_tag
from tests.rpc.test_metrics import samples, value
from tests.servers import RedisServer
from tests.test_engine import (
    CHUNK,
    TIMEOUT,
    Scene,
    assert_same_caches,
    clone_caches,
    config,
    expected_target,
    random_tokens,
)

PROMPT = 3 * CHUNK  # three whole chunks
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 8 * 2  # layers x K/V x tokens x heads x head size x fp16
QUOTA_CHUNKS = 6
PAGE = page_size_for(CHUNK_BYTES)  # the pool's page: each chunk of these tests takes one


def quota_gb(chunks: int) -> float:
    # A little over the chunks' bytes: disk and Redis count each record's header too.
    return chunks * (CHUNK_BYTES + 256) / GB


async def store(
    engine: CacheEngine, scene: Scene, tokens: list[int], tenant: str, **options: Any
) -> int:
    return await engine.store(
        tokens,
        kv_caches=scene.source,
        slot_mapping=scene.src_slots[:PROMPT],
        tenant=tenant,
        **options,
    )


async def retrieve_exactly(
    engine: CacheEngine, scene: Scene, tokens: list[int], tenant: str, **options: Any
) -> None:
    """Retrieve a whole prompt stored by :func:`store`: every token is loaded, and the
    target caches hold the source's KV at the prompt's slots and nothing new elsewhere."""
    before = clone_caches(scene.target)
    loaded = await engine.retrieve(
        tokens,
        kv_caches=scene.target,
        slot_mapping=scene.dst_slots[:PROMPT],
        tenant=tenant,
        **options,
    )
    assert loaded.tolist() == [True] * PROMPT
    want = expected_target(
        scene.kind,
        before=before,
        source=scene.source,
        src_slots=scene.src_slots[:PROMPT],
        dst_slots=scene.dst_slots[:PROMPT],
        loaded=loaded,
    )
    assert_same_caches(scene.kind, scene.target, want)


def usage(engine: CacheEngine, tier: str, tenant: str) -> tuple[int, int]:
    tenants = engine.stats().tiers[tier].tenants
    got = tenants.get(tenant_tag(tenant).hex())
    return (0, 0) if got is None else (got.chunks, got.bytes)


def evictions(engine: CacheEngine, tier: str, tenant: str) -> int:
    """Chunks of ``tenant`` the tier evicted (for its quota, or to make room)."""
    got = engine.stats().tiers[tier].tenants.get(tenant_tag(tenant).hex())
    return 0 if got is None else got.evictions


TIER_SETTINGS: Mapping[str, Mapping[str, Any]] = {
    "cpu": {"store_location": ["cpu"]},
    "disk": {"store_location": ["disk"], "wait_for_slow_tiers": True},
    "redis": {"store_location": ["redis"], "wait_for_slow_tiers": True},
}


@pytest.mark.anyio
@pytest.mark.parametrize("tier", list(TIER_SETTINGS))
async def test_a_tenant_writing_ten_times_its_quota_evicts_only_its_own_chunks(
    tier: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    overrides: dict[str, Any] = dict(TIER_SETTINGS[tier])
    overrides["retrieve_locations"] = [tier]
    if tier == "disk":
        overrides["local_disk"] = str(tmp_path)
    if tier == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        overrides["remote_url"] = server.url
    quota = quota_gb(QUOTA_CHUNKS)
    overrides["tenant_quotas"] = {tier: {"a": quota, "b": quota}}
    scene = Scene.build("flash_nhd", torch.float16, PROMPT, seed=21)
    b_prompts = [random_tokens(PROMPT, 500 + i) for i in range(2)]  # 6 chunks: b's quota
    with anyio.fail_after(TIMEOUT * 3):
        async with CacheEngine.open(config(**overrides), scene.layout, model_name="m") as engine:
            for tokens in b_prompts:
                assert await store(engine, scene, tokens, "b") == PROMPT
            for i in range(10 * QUOTA_CHUNKS // 3):  # ten times a's quota
                await store(engine, scene, random_tokens(PROMPT, 900 + i), "a")
            for tokens in b_prompts:
                assert await engine.lookup(tokens, tenant="b") == PROMPT
            a_chunks, a_bytes = usage(engine, tier, "a")
            assert 0 < a_chunks <= QUOTA_CHUNKS
            assert a_bytes <= quota * GB
            assert usage(engine, tier, "b")[0] == 2 * 3
            # a's newest prompt is there, its oldest was evicted for its own newer ones.
            assert await engine.lookup(random_tokens(PROMPT, 900 + 19), tenant="a") == PROMPT
            assert await engine.lookup(random_tokens(PROMPT, 900), tenant="a") == 0


@pytest.mark.anyio
async def test_a_named_tenant_within_its_quota_is_never_evicted_for_another() -> None:
    # The pool holds 24 chunks (a page each); "a" has no quota and writes far more.
    pool_gb = 24 * PAGE / GB
    scene = Scene.build("flash_nhd", torch.float16, PROMPT, seed=22)
    settings = config(
        max_local_cpu_size=pool_gb,
        tenant_quotas={"cpu": {"b": quota_gb(QUOTA_CHUNKS)}},
        allocation_timeout=1.0,
    )
    b_prompts = [random_tokens(PROMPT, 600 + i) for i in range(2)]
    with anyio.fail_after(TIMEOUT * 3):
        async with CacheEngine.open(settings, scene.layout, model_name="m") as engine:
            for tokens in b_prompts:
                assert await store(engine, scene, tokens, "b") == PROMPT
            for i in range(30):
                assert await store(engine, scene, random_tokens(PROMPT, 700 + i), "a") == PROMPT
            for tokens in b_prompts:
                assert await engine.lookup(tokens, tenant="b") == PROMPT
            assert await engine.lookup(random_tokens(PROMPT, 700), tenant="a") == 0
            assert engine.stats().tiers["cpu"].evictions > 0


class HeldDiskWrites:
    """Holds every disk write until :meth:`release`, counting the chunks handed to the
    disk: the stores return meanwhile only if they do not wait for it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.released = anyio.Event()
        self.chunks_held = 0
        put = DiskBackend.put

        async def held_put(
            tier: DiskBackend, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj], **kw: Any
        ) -> int:
            self.chunks_held += len(keys)
            await self.released.wait()
            return await put(tier, keys, objs, **kw)

        monkeypatch.setattr(DiskBackend, "put", held_put)

    def release(self) -> None:
        self.released.set()


@pytest.mark.anyio
async def test_writes_behind_the_stores_keep_each_tenant_within_its_disk_quota(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    quota = quota_gb(QUOTA_CHUNKS)
    settings = config(
        local_disk=str(tmp_path),
        store_location=["disk"],
        retrieve_locations=["disk"],
        wait_for_slow_tiers=False,
        tenant_quotas={"disk": {"a": quota, "b": quota}},
    )
    scene = Scene.build("flash_nhd", torch.float16, PROMPT, seed=23)
    b_prompts = [random_tokens(PROMPT, 800 + i) for i in range(2)]  # 6 chunks: b's quota
    a_prompts = [random_tokens(PROMPT, 1000 + i) for i in range(10 * QUOTA_CHUNKS // 3)]
    disk = HeldDiskWrites(monkeypatch)
    with anyio.fail_after(TIMEOUT * 3):
        async with CacheEngine.open(settings, scene.layout, model_name="m") as engine:
            with anyio.fail_after(TIMEOUT):  # a store that waited for the disk would hang
                for tokens in b_prompts:
                    assert await store(engine, scene, tokens, "b") == PROMPT
                for tokens in a_prompts:  # ten times a's quota
                    assert await store(engine, scene, tokens, "a") == PROMPT
            held = engine.stats()
            assert held.tier_writes_pending == len(b_prompts) + len(a_prompts)
            assert usage(engine, "disk", "a") == usage(engine, "disk", "b") == (0, 0)
            disk.release()
            assert await engine.flush()
            stats = engine.stats()
            assert (stats.tier_writes_pending, stats.tier_writes_dropped) == (0, 0)
            assert stats.tier_writes_failed == 0
            assert disk.chunks_held == 3 * (len(b_prompts) + len(a_prompts))
            a_chunks, a_bytes = usage(engine, "disk", "a")
            assert a_chunks == QUOTA_CHUNKS
            assert a_bytes <= quota * GB
            assert usage(engine, "disk", "b")[0] == 2 * 3
            assert evictions(engine, "disk", "a") == 3 * len(a_prompts) - QUOTA_CHUNKS
            assert evictions(engine, "disk", "b") == 0
            for tokens in b_prompts:
                assert await engine.lookup(tokens, tenant="b") == PROMPT
                await retrieve_exactly(engine, scene, tokens, "b")
            # a keeps its newest prompts; its older ones went for them.
            hits = [await engine.lookup(tokens, tenant="a") for tokens in a_prompts]
            assert hits == [0] * (len(a_prompts) - 2) + [PROMPT] * 2
            await retrieve_exactly(engine, scene, a_prompts[-1], "a")


@pytest.mark.anyio
async def test_chunks_promoted_from_disk_keep_their_tenant_within_its_cpu_quota(
    tmp_path: Path,
) -> None:
    quota = quota_gb(QUOTA_CHUNKS)
    settings = config(
        local_disk=str(tmp_path),
        wait_for_slow_tiers=True,
        tenant_quotas={"cpu": {"a": quota, "b": quota}},
    )
    scene = Scene.build("flash_nhd", torch.float16, PROMPT, seed=24)
    b_prompts = [random_tokens(PROMPT, 1100 + i) for i in range(2)]  # 6 chunks: b's quota
    a_prompts = [random_tokens(PROMPT, 1200 + i) for i in range(10 * QUOTA_CHUNKS // 3)]
    with anyio.fail_after(TIMEOUT * 3):
        async with CacheEngine.open(settings, scene.layout, model_name="m") as engine:
            for tokens in b_prompts:
                stored = await store(engine, scene, tokens, "b", store_location=["cpu", "disk"])
                assert stored == PROMPT
            for tokens in a_prompts:  # on disk only: all that a holds in RAM is promoted
                assert await store(engine, scene, tokens, "a", store_location=["disk"]) == PROMPT
            assert usage(engine, "cpu", "a") == (0, 0)
            for tokens in a_prompts:  # ten times a's quota, read from disk into RAM
                await retrieve_exactly(engine, scene, tokens, "a")
                a_chunks, a_bytes = usage(engine, "cpu", "a")
                assert 0 < a_chunks <= QUOTA_CHUNKS
                assert a_bytes <= quota * GB
            stats = engine.stats()
            assert stats.promoted_chunks == 3 * len(a_prompts)
            assert usage(engine, "cpu", "a")[0] == QUOTA_CHUNKS
            # Only a's own chunks made room: all but its last quota's worth of promotions.
            assert evictions(engine, "cpu", "a") == 3 * len(a_prompts) - QUOTA_CHUNKS
            assert stats.tiers["cpu"].evictions == evictions(engine, "cpu", "a")
            assert evictions(engine, "cpu", "b") == 0
            assert usage(engine, "cpu", "b")[0] == 2 * 3
            for tokens in b_prompts:
                assert await engine.lookup(tokens, tenant="b", search_range=["cpu"]) == PROMPT
                await retrieve_exactly(engine, scene, tokens, "b", retrieve_locations=["cpu"])
            in_ram = [
                await engine.lookup(tokens, tenant="a", search_range=["cpu"])
                for tokens in a_prompts
            ]
            assert in_ram == [0] * (len(a_prompts) - 2) + [PROMPT] * 2


# -- pins count against the CPU quota --------------------------------------------------------

PIN_PROMPT = 2 * CHUNK  # two whole chunks


def pins_settings(tmp_path: Path) -> dict[str, Any]:
    """A pool of 8 chunks; "a" may hold 2 of them in the CPU tier, "b" 4."""
    return {
        "local_disk": str(tmp_path),
        "wait_for_slow_tiers": True,
        "max_local_cpu_size": 8 * PAGE / GB,
        "allocation_timeout": 1.0,
        "tenant_quotas": {"cpu": {"a": quota_gb(2), "b": quota_gb(4)}},
    }


async def store_prompt(
    engine: CacheEngine, scene: Scene, tokens: list[int], tenant: str, **options: Any
) -> int:
    return await engine.store(
        tokens,
        kv_caches=scene.source,
        slot_mapping=scene.src_slots[: len(tokens)],
        tenant=tenant,
        **options,
    )


def pins_refused(engine: CacheEngine, tenant: str) -> int:
    got = engine.stats().tiers["cpu"].tenants.get(tenant_tag(tenant).hex())
    return 0 if got is None else got.pins_refused


@pytest.mark.anyio
async def test_prefetches_past_a_tenants_cpu_quota_stop_short_and_leave_others_room(
    tmp_path: Path,
) -> None:
    """The reported case: a tenant with a 2-chunk CPU quota prefetches 4 prompts of 2
    chunks from disk (8 chunks: the whole pool); its pins stop at its quota, and another
    tenant within its own quota then stores a whole prompt."""
    scene = Scene.build("flash_nhd", torch.float16, PROMPT, seed=25)
    a_prompts = [random_tokens(PIN_PROMPT, 1300 + i) for i in range(4)]
    b_prompt = random_tokens(PROMPT, 1400)
    with anyio.fail_after(TIMEOUT * 3):
        settings = config(**pins_settings(tmp_path))
        async with CacheEngine.open(settings, scene.layout, model_name="m") as engine:
            for tokens in a_prompts:
                stored = await store_prompt(engine, scene, tokens, "a", store_location=["disk"])
                assert stored == PIN_PROMPT
            load = engine._parts.core.load
            for i, tokens in enumerate(a_prompts):
                assert await engine.prefetch(tokens, lookup_id=f"a{i}", tenant="a") == PIN_PROMPT
                prefetch = load.prefetching(f"a{i}")
                assert prefetch is not None
                await prefetch.done.wait()
            stats = engine.stats()
            assert stats.pinned_chunks == 2, "a's pins stop at its quota"
            assert pins_refused(engine, "a") == 3 * 2
            assert engine.tenant_stats("a").pins_refused == 3 * 2
            label = next(
                name for name, t in stats.tenants.items() if t.tag == tenant_tag("a").hex()
            )
            exposition = prometheus_client.generate_latest(
                make_registry(EngineCollector(engine.stats))
            )
            scraped = samples(exposition.decode())
            name = "lmcache_async_tenant_pins_refused_total"
            assert value(scraped, name, tenant=label, tier="cpu") == 3 * 2
            assert usage(engine, "cpu", "a")[1] <= quota_gb(2) * GB
            assert stats.pool.used_bytes <= 2 * PAGE
            assert await store_prompt(engine, scene, b_prompt, "b") == PROMPT
            assert engine.stats().partial_stores == 0
            assert await engine.lookup(b_prompt, tenant="b", search_range=["cpu"]) == PROMPT
            await retrieve_exactly(engine, scene, b_prompt, "b")
            # A prefetch cut short still loads: its retrieve reads the rest from disk.
            loaded = await engine.retrieve(
                a_prompts[3],
                kv_caches=scene.target,
                slot_mapping=scene.dst_slots[:PIN_PROMPT],
                tenant="a",
                lookup_id="a3",
            )
            assert loaded.tolist() == [True] * PIN_PROMPT
            for i in range(3):
                await engine.lookup_unpin(f"a{i}")
            assert engine.stats().pinned_chunks == 0
            assert usage(engine, "cpu", "a")[0] <= 2


@pytest.mark.anyio
async def test_a_tenant_without_a_quota_prefetches_as_before(tmp_path: Path) -> None:
    scene = Scene.build("flash_nhd", torch.float16, PROMPT, seed=26)
    prompts = [random_tokens(PIN_PROMPT, 1500 + i) for i in range(3)]
    with anyio.fail_after(TIMEOUT * 3):
        settings = config(**pins_settings(tmp_path))
        async with CacheEngine.open(settings, scene.layout, model_name="m") as engine:
            for tokens in prompts:
                stored = await store_prompt(engine, scene, tokens, "c", store_location=["disk"])
                assert stored == PIN_PROMPT
            for i, tokens in enumerate(prompts):
                await engine.prefetch(tokens, lookup_id=f"c{i}", tenant="c")
                prefetch = engine._parts.core.load.prefetching(f"c{i}")
                assert prefetch is not None
                await prefetch.done.wait()
            assert engine.stats().pinned_chunks == 3 * 2
            assert pins_refused(engine, "c") == 0
