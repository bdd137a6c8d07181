"""Tenant quotas through the engine, in each tier: a tenant that writes ten times its
quota evicts only its own chunks, and another tenant's prompts, within their quota, stay
whole hits; a tenant named in the quotas is never evicted to make room for another."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from lmcache_async import CacheEngine
from lmcache_async.config import GB
from lmcache_async.tenants import tenant_tag
from tests.servers import RedisServer
from tests.test_engine import CHUNK, TIMEOUT, Scene, config, random_tokens

PROMPT = 3 * CHUNK  # three whole chunks
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 8 * 2  # layers x K/V x tokens x heads x head size x fp16
QUOTA_CHUNKS = 6


def quota_gb(chunks: int) -> float:
    # A little over the chunks' bytes: disk and Redis count each record's header too.
    return chunks * (CHUNK_BYTES + 256) / GB


async def store(engine: CacheEngine, scene: Scene, tokens: list[int], tenant: str) -> int:
    return await engine.store(
        tokens, kv_caches=scene.source, slot_mapping=scene.src_slots[:PROMPT], tenant=tenant
    )


def usage(engine: CacheEngine, tier: str, tenant: str) -> tuple[int, int]:
    tenants = engine.stats().tiers[tier].tenants
    got = tenants.get(tenant_tag(tenant).hex())
    return (0, 0) if got is None else (got.chunks, got.bytes)


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
    # The pool holds 24 chunks (a page of 64 KiB each); "a" has no quota and writes far
    # more than that.
    pool_gb = 24 * 65536 / GB
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
