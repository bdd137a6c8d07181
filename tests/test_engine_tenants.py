"""Tenants per request: the same prompt of two tenants never shares a chunk, in the CPU
tier and on disk; every key of a tenant carries its tag; a lookup by digests names the
tenant it is for, and another tenant's digests are refused. Two names chosen so that their
tags agreed on 4 bytes are two tenants for erasure, quotas and lookups; figures and logs
show a tenant by label or tag, never by name."""

from __future__ import annotations

import math
from pathlib import Path

import anyio
import pytest
import structlog
import torch

from lmcache_async import CacheEngine, InvalidInputError
from lmcache_async.config import GB
from lmcache_async.rpc.protocol import to_wire
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


# -- tenants an attacker chose to collide ---------------------------------------------------

# Two names whose tags agreed when a tag was 4 bytes (found in a few seconds: a birthday
# search over 2**32); whatever a tier does by tag then treated them as one tenant.
VICTIM, ATTACKER = "user-11373", "user-45807"


def test_names_that_collided_on_4_bytes_have_different_tags() -> None:
    victim, attacker = tenant_tag(VICTIM), tenant_tag(ATTACKER)
    assert victim[:4] == attacker[:4], "the pair this module's tests are about"
    assert len(victim) == len(attacker) == TAG_BYTES == 16
    assert victim != attacker


async def _store_both(engine: CacheEngine, victim: Scene, attacker: Scene) -> None:
    for scene, tenant in ((victim, VICTIM), (attacker, ATTACKER)):
        stored = await engine.store(
            scene.tokens, kv_caches=scene.source, slot_mapping=scene.src_slots, tenant=tenant
        )
        assert stored == N


@pytest.mark.anyio
async def test_erasing_one_of_two_once_colliding_tenants_leaves_the_other(tmp_path: Path) -> None:
    victim = Scene.build("flash_nhd", torch.float16, N, seed=21)
    attacker = Scene.build("flash_nhd", torch.float16, N, seed=22)
    settings = config(local_disk=str(tmp_path), wait_for_slow_tiers=True)
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(settings, victim.layout, model_name="m") as engine:
            await _store_both(engine, victim, attacker)
            removed = await engine.erase(ATTACKER)
            assert removed == {"cpu": 4, "disk": 4}  # its own four chunks, no more
            assert await engine.lookup(attacker.tokens, tenant=ATTACKER) == 0
            assert await engine.lookup(victim.tokens, tenant=VICTIM) == N
            await engine.clear(["cpu"])
            assert await engine.lookup(victim.tokens, tenant=VICTIM) == N  # from disk
    assert len(_files_of(tmp_path, VICTIM)) == 4 and _files_of(tmp_path, ATTACKER) == []


@pytest.mark.anyio
async def test_a_quota_of_one_once_colliding_tenant_does_not_bind_the_other() -> None:
    victim = Scene.build("flash_nhd", torch.float16, N, seed=23)
    attacker = Scene.build("flash_nhd", torch.float16, N, seed=24)
    layout = victim.layout
    chunk_bytes = math.prod(layout.payload_shape(CHUNK)) * layout.dtype.itemsize
    quota = {"cpu": {VICTIM: 1.5 * chunk_bytes / GB}}  # room for one chunk of the victim
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(config(tenant_quotas=quota), layout, model_name="m") as engine:
            # The attacker, who has no quota, fills the victim's quota and more...
            stored = await engine.store(
                attacker.tokens,
                kv_caches=attacker.source,
                slot_mapping=attacker.src_slots,
                tenant=ATTACKER,
            )
            assert stored == N
            assert await engine.lookup(attacker.tokens, tenant=ATTACKER) == N
            # ...and the victim's own stores evict only the victim's chunks.
            await engine.store(
                victim.tokens, kv_caches=victim.source, slot_mapping=victim.src_slots, tenant=VICTIM
            )
            assert await engine.lookup(attacker.tokens, tenant=ATTACKER) == N
            figures = engine.stats().tenants
    usage = {label: figures[label].tiers["cpu"] for label in figures}
    attacker_usage = usage[tenant_tag(ATTACKER).hex()]
    victim_usage = usage[tenant_tag(VICTIM).hex()]
    assert (attacker_usage.chunks, attacker_usage.quota_bytes) == (4, None)
    # The victim is held to its own quota (a whole chunk and the short last one fit).
    assert victim_usage.quota_bytes == int(1.5 * chunk_bytes) >= victim_usage.bytes
    assert victim_usage.chunks < 4


@pytest.mark.anyio
async def test_another_tenants_published_digests_neither_hit_nor_pin() -> None:
    victim = Scene.build("flash_nhd", torch.float16, N, seed=25)
    async with CacheEngine.open(config(), victim.layout, model_name="m") as engine:
        await engine.store(
            victim.tokens, kv_caches=victim.source, slot_mapping=victim.src_slots, tenant=VICTIM
        )
        published = engine.hasher_for(VICTIM).digests(victim.tokens)
        with pytest.raises(InvalidInputError, match="not of the tenant named"):
            await engine.lookup_digests(published, N, tenant=ATTACKER, lookup_id="x", pin=True)
        # Forged: the attacker's own tag ahead of the victim's chain links.
        own = tenant_tag(ATTACKER)
        forged = [own + digest[TAG_BYTES:] for digest in published]
        assert await engine.lookup_digests(forged, N, tenant=ATTACKER, lookup_id="y", pin=True) == 0
        assert engine.stats().pinned_chunks == 0
        assert await engine.lookup_digests(published, N, tenant=VICTIM) == N


# -- figures and logs never carry a name ----------------------------------------------------

SECRET = "cache-salt-9b1f3c77e2"
"""A tenant name as vLLM's ``cache_salt`` carries it: a secret."""


@pytest.mark.anyio
async def test_figures_and_logs_show_labels_and_tags_never_names(tmp_path: Path) -> None:
    scene = Scene.build("flash_nhd", torch.float16, N, seed=26)
    settings = config(
        local_disk=str(tmp_path),
        wait_for_slow_tiers=True,
        tenant_labels={VICTIM: "team-victim"},
        log_level="DEBUG",
    )
    with anyio.fail_after(TIMEOUT), structlog.testing.capture_logs() as logs:
        async with CacheEngine.open(settings, scene.layout, model_name="m") as engine:
            for tenant in (VICTIM, SECRET):
                await engine.store(
                    scene.tokens,
                    kv_caches=scene.source,
                    slot_mapping=scene.src_slots,
                    tenant=tenant,
                )
                assert await engine.lookup(scene.tokens, tenant=tenant) == N
            stats = engine.stats()
            assert engine.tenant_stats(SECRET) == stats.tenants[tenant_tag(SECRET).hex()]
            await engine.erase(SECRET)
            await engine.erase(VICTIM)
            after = engine.stats()
    wire = repr(to_wire(stats)) + repr(to_wire(after))
    assert set(stats.tenants) == {"team-victim", tenant_tag(SECRET).hex()}
    assert "team-victim" in wire and tenant_tag(SECRET).hex() in wire
    erased = [entry for entry in logs if entry["event"] == "tenant_erased"]
    assert [entry["tag"] for entry in erased] == [
        tenant_tag(SECRET).hex(),
        tenant_tag(VICTIM).hex(),
    ]
    logged = repr(logs)
    for name in (SECRET, VICTIM):
        assert name not in wire and name not in logged
