"""Tenants per request: the same prompt of two tenants never shares a chunk, in the CPU
tier and on disk; every key of a tenant carries its tag; a lookup by digests names the
tenant it is for, and another tenant's digests are refused."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from lmcache_async import CacheEngine, InvalidInputError
from lmcache_async.tenancy.tenants import TAG_BYTES, tenant_tag
from tests.test_engine import (
    CHUNK,
    TIMEOUT,
    Scene,
    config,
    prefix_mask,
)

N = 3 * CHUNK + 5


@pytest.mark.anyio
@pytest.mark.parametrize("tiers", ["cpu", "disk"])
async def test_a_prompt_stored_for_one_tenant_is_found_only_by_that_tenant(
    tiers: str, tmp_path: Path
) -> None:
    scene = Scene.build("flash_nhd", torch.float16, N, seed=7)
    overrides = {} if tiers == "cpu" else {"local_disk": str(tmp_path), "wait_for_slow_tiers": True}
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(config(**overrides), scene.layout, model_name="m") as engine:
            stored = await engine.store(
                scene.tokens, kv_caches=scene.source, slot_mapping=scene.src_slots, tenant="a"
            )
            assert stored == N
            if tiers == "disk":
                await engine.clear(["cpu"])  # only the disk tier holds it now
            assert await engine.lookup(scene.tokens, tenant="b") == 0
            assert await engine.lookup(scene.tokens) == 0  # the engine's own tenant
            before = [t.clone() for t in scene.target]
            loaded = await engine.retrieve(
                scene.tokens, kv_caches=scene.target, slot_mapping=scene.dst_slots, tenant="b"
            )
            assert not loaded.any()
            assert all(torch.equal(a, b) for a, b in zip(before, scene.target, strict=True))
            assert await engine.lookup(scene.tokens, tenant="a") == N
            loaded = await engine.retrieve(
                scene.tokens, kv_caches=scene.target, slot_mapping=scene.dst_slots, tenant="a"
            )
            assert loaded.tolist() == prefix_mask(N, 0, N).tolist()
    if tiers == "disk":
        assert _files_of(tmp_path, "a"), "the tenant's chunk files start with its tag"


def _files_of(directory: Path, tenant: str) -> list[str]:
    tag = tenant_tag(tenant).hex()
    return [p.name for p in directory.rglob("*") if p.is_file() and p.name.startswith(tag)]


@pytest.mark.anyio
async def test_every_key_of_a_tenant_starts_with_its_tag() -> None:
    scene = Scene.build("flash_nhd", torch.float16, N, seed=8)
    async with CacheEngine.open(config(), scene.layout, model_name="m", tenant="own") as engine:
        for tenant, expected in (("x", "x"), (None, "own"), ("own", "own")):
            spans, _ = await engine.chunk_spans(scene.tokens, tenant=tenant)
            assert {bytes(span.key[:TAG_BYTES]) for span in spans} == {tenant_tag(expected)}
            assert engine.hasher_for(tenant).tag == tenant_tag(expected)
        own, _ = await engine.chunk_spans(scene.tokens)
        other, _ = await engine.chunk_spans(scene.tokens, tenant="x")
        assert not {s.key for s in own} & {s.key for s in other}


@pytest.mark.anyio
async def test_a_lookup_by_digests_takes_only_the_named_tenants_digests() -> None:
    scene = Scene.build("flash_nhd", torch.float16, N, seed=9)
    async with CacheEngine.open(config(), scene.layout, model_name="m") as engine:
        await engine.store(
            scene.tokens, kv_caches=scene.source, slot_mapping=scene.src_slots, tenant="a"
        )
        digests = engine.hasher_for("a").digests(scene.tokens)
        assert await engine.lookup_digests(digests, N, tenant="a") == N
        with pytest.raises(InvalidInputError, match="not of the tenant named"):
            await engine.lookup_digests(digests, N, tenant="b")
        with pytest.raises(InvalidInputError, match="not of the tenant named"):
            await engine.lookup_digests(b"".join(digests), N)  # the engine's own tenant


@pytest.mark.anyio
@pytest.mark.parametrize("bad", [7, b"a", "x" * 257, "\ud800"])
async def test_a_bad_tenant_is_refused_before_anything_is_stored(bad: object) -> None:
    scene = Scene.build("flash_nhd", torch.float16, N, seed=10)
    async with CacheEngine.open(config(), scene.layout, model_name="m") as engine:
        with pytest.raises(InvalidInputError, match="tenant"):
            await engine.store(
                scene.tokens,
                kv_caches=scene.source,
                slot_mapping=scene.src_slots,
                tenant=bad,  # type: ignore[arg-type]
            )
        with pytest.raises(InvalidInputError, match="tenant"):
            await engine.lookup(scene.tokens, tenant=bad)  # type: ignore[arg-type]
        assert engine.stats().cached_chunks == 0


def _disk_bytes(directory: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file())


@pytest.mark.anyio
@pytest.mark.parametrize("sealed", [True, False], ids=["encrypted", "clear"])
async def test_an_engine_with_a_key_file_keeps_its_disk_records_sealed(
    sealed: bool, tmp_path: Path
) -> None:
    scene = Scene.build("flash_nhd", torch.float16, N, seed=11)
    key_file = tmp_path / "master.key"
    key_file.write_text(bytes(range(32)).hex())
    disk = tmp_path / "disk"
    settings = config(
        local_disk=str(disk),
        wait_for_slow_tiers=True,
        encryption_key_file=str(key_file) if sealed else None,
    )
    # The first token's K values, as they lie in the source caches (32 random bytes).
    slot = int(scene.src_slots[0])
    row = scene.source[0][0].reshape(-1, scene.source[0].shape[-2] * scene.source[0].shape[-1])
    sample = row[slot].contiguous().view(torch.uint8).numpy().tobytes()
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(settings, scene.layout, model_name="m") as engine:
            assert (
                await engine.store(
                    scene.tokens, kv_caches=scene.source, slot_mapping=scene.src_slots
                )
                == N
            )
            await engine.clear(["cpu"])
            stored = await anyio.to_thread.run_sync(_disk_bytes, disk)
            assert (sample in stored) is not sealed
            await scene.retrieve_and_check(engine, prefix_mask(N, 0, N))  # bit-exact
            assert engine.stats().tiers["disk"].corrupt == 0
