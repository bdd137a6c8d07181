"""CacheEngine.promise: only chunks verified in host memory are promised. CPU-tier hits at
once; disk hits after a prefetch that answers "pending" meanwhile; a corrupt, truncated or
vanished file ends the promise before it; ``finish`` stops the reading; the pins hold the
chunks until the load and go with it, with ``lookup_unpin`` or when the prompt changes."""

from __future__ import annotations

import math
from pathlib import Path

import anyio
import pytest
import torch

from lmcache_async import CacheEngine, InvalidInputError, Promise
from lmcache_async.backends.disk import DiskBackend
from lmcache_async.config import GB
from lmcache_async.memory.pool import page_size_for
from tests.test_engine_tiers import (
    CHUNK,
    TIMEOUT,
    chunk_files,
    engine_on,
    layout,
    retrieve,
    store,
    tokens_of,
)


async def settled(
    engine: CacheEngine, n: int, lookup_id: str, seed: int = 1, tenant: str | None = None
) -> Promise:
    """Ask until the answer is not pending, waiting for the prefetch between the asks."""
    promise = await engine.promise(tokens_of(n, seed), lookup_id=lookup_id, tenant=tenant)
    while promise.pending:
        prefetch = engine._parts.core.load.prefetching(lookup_id)
        assert prefetch is not None
        await prefetch.done.wait()
        promise = await engine.promise(tokens_of(n, seed), lookup_id=lookup_id, tenant=tenant)
    return promise


@pytest.mark.anyio
async def test_cpu_hits_are_promised_at_once_and_pinned_until_the_load(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path, local_disk=None) as engine:
            await store(engine, 70)
            promise = await engine.promise(tokens_of(70, 1), lookup_id="r1")
            assert promise == Promise(70, False)
            assert engine.stats().pinned_chunks == 5
            await retrieve(engine, 70, 70, lookup_id="r1")
            assert engine.stats().pinned_chunks == 0


@pytest.mark.anyio
async def test_disk_hits_are_pending_until_verified_in_host_memory(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            await store(engine, 70)
        async with engine_on(tmp_path) as engine:
            first = await engine.promise(tokens_of(70, 1), lookup_id="r1")
            assert first == Promise(0, True)  # nothing in host memory yet
            assert await settled(engine, 70, "r1") == Promise(70, False)
            stats = engine.stats()
            assert stats.pinned_chunks == 5
            assert stats.tiers["cpu"].chunks == 5  # promoted on the way
            # Asked again (vLLM re-asks a request it could not schedule): the same answer.
            assert await engine.promise(tokens_of(70, 1), lookup_id="r1") == Promise(70, False)
            await retrieve(engine, 70, 70, lookup_id="r1")
            assert engine.stats().pinned_chunks == 0


@pytest.mark.anyio
async def test_a_promise_that_may_wait_answers_once_its_reads_end(tmp_path: Path) -> None:
    """With ``wait`` the first ask waits for the disk reads it starts and promises them:
    no "pending" answer for the scheduler to ask again after."""
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            await store(engine, 70)
        async with engine_on(tmp_path) as engine:
            first = await engine.promise(tokens_of(70, 1), lookup_id="r1", wait=TIMEOUT / 2)
            assert first == Promise(70, False)
            assert engine.stats().pinned_chunks == 5
            await retrieve(engine, 70, 70, lookup_id="r1")
            assert engine.stats().pinned_chunks == 0


@pytest.mark.anyio
async def test_a_promise_waits_no_longer_than_it_may(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads that do not end within ``wait`` leave the answer pending (the reads held
    until the test lets them go)."""
    gate = anyio.Event()
    fetch = DiskBackend.get

    async def held(self: DiskBackend, *args: object, **kwargs: object) -> object:
        await gate.wait()
        return await fetch(self, *args, **kwargs)  # type: ignore[arg-type]

    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            await store(engine, 70)
        monkeypatch.setattr(DiskBackend, "get", held)
        async with engine_on(tmp_path) as engine:
            first = await engine.promise(tokens_of(70, 1), lookup_id="r1", wait=0.05)
            assert first == Promise(0, True)
            gate.set()
            assert await settled(engine, 70, "r1") == Promise(70, False)
            await retrieve(engine, 70, 70, lookup_id="r1")


@pytest.mark.anyio
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
async def test_a_bad_file_ends_the_promise_before_it(tmp_path: Path, damage: str) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            await store(engine, 64)
        async with engine_on(tmp_path) as engine:
            disk = engine._parts.manager.tier("disk")
            assert isinstance(disk, DiskBackend)
            assert await disk.wait_index(audited=True)  # the file is known before it goes bad
            third = engine.key_hasher.spans(tokens_of(64, 1))[2].key.to_str()
            (victim,) = [p for p in chunk_files(tmp_path) if p.name.startswith(third)]
            data = bytearray(victim.read_bytes())
            if damage == "flip":
                data[-5] ^= 0x40
                victim.write_bytes(bytes(data))
            elif damage == "truncate":
                victim.write_bytes(bytes(data[: len(data) // 2]))
            else:
                victim.unlink()
            assert await settled(engine, 64, "r1") == Promise(2 * CHUNK, False)
            await retrieve(engine, 64, 2 * CHUNK, lookup_id="r1")
            stats = engine.stats()
            assert stats.pinned_chunks == 0
            assert (stats.promises, stats.promised_tokens) == (1, 2 * CHUNK)
            assert stats.promise_shortfall_tokens == 2 * CHUNK  # chosen, never verified
            if damage != "delete":
                assert stats.tiers["disk"].corrupt == 1
                assert not victim.exists()


@pytest.mark.anyio
async def test_finish_stops_the_reading_and_promises_what_arrived(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path, pipeline_batch_chunks=1) as engine:
            await store(engine, 64)
        async with engine_on(tmp_path, pipeline_batch_chunks=1) as engine:
            assert (await engine.promise(tokens_of(64, 1), lookup_id="r1")).pending
            final = await engine.promise(tokens_of(64, 1), lookup_id="r1", finish=True)
            assert not final.pending
            assert engine.stats().promises_cut_short == 1
            assert final.tokens % CHUNK == 0
            assert engine.stats().pinned_chunks == final.tokens // CHUNK
            assert engine._parts.core.load.prefetching("r1") is not None  # the load waits on it
            await retrieve(engine, 64, 64, lookup_id="r1")  # a load may read beyond the promise
            assert engine.stats().pinned_chunks == 0


@pytest.mark.anyio
async def test_unpin_drops_the_promise_and_its_reading(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            await store(engine, 64)
        async with engine_on(tmp_path) as engine:
            assert (await engine.promise(tokens_of(64, 1), lookup_id="r1")).pending
            prefetch = engine._parts.core.load.prefetching("r1")
            assert prefetch is not None
            await engine.lookup_unpin("r1")
            assert engine._parts.core.load.prefetching("r1") is None
            await prefetch.done.wait()
            assert engine.stats().pinned_chunks == 0  # the abandoned reading pinned nothing
            # Asked again after its pins went: a fresh promise, which finds the chunks
            # the abandoned reading may have promoted or reads them again.
            assert await settled(engine, 64, "r1") == Promise(64, False)
            await engine.lookup_unpin("r1")
            assert engine.stats().pinned_chunks == 0


@pytest.mark.anyio
async def test_another_prompt_under_the_same_id_is_promised_afresh(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path, local_disk=None) as engine:
            await store(engine, 64)
            assert await engine.promise(tokens_of(64, 1), lookup_id="r1") == Promise(64, False)
            other = await engine.promise(tokens_of(64, 2), lookup_id="r1")
            assert other == Promise(0, False)
            assert engine.stats().pinned_chunks == 0


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"computed_tokens": -1}, "computed_tokens"),
        ({"computed_tokens": 1.5}, "computed_tokens"),
        ({"prefill_tokens_per_s": 0}, "prefill_tokens_per_s"),
        ({"prefill_tokens_per_s": float("nan")}, "prefill_tokens_per_s"),
        ({"lookup_id": None}, "lookup_id"),
        ({"wait": -1}, "wait"),
        ({"wait": float("inf")}, "wait"),
        ({"wait": 61}, "wait"),
        ({"wait": True}, "wait"),
    ],
)
async def test_bad_arguments_are_refused_by_name(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path, local_disk=None) as engine:
            arguments: dict[str, object] = {"lookup_id": "r1", **kwargs}
            with pytest.raises(InvalidInputError, match=message):
                await engine.promise(tokens_of(16, 1), **arguments)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_chunks_the_serving_engine_has_are_not_read(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            await store(engine, 64)
        async with engine_on(tmp_path) as engine:
            tokens = tokens_of(64, 1)
            first = await engine.promise(tokens, lookup_id="r1", computed_tokens=2 * CHUNK + 3)
            assert first.pending
            prefetch = engine._parts.core.load.prefetching("r1")
            assert prefetch is not None
            await prefetch.done.wait()
            assert await engine.promise(tokens, lookup_id="r1") == Promise(64, False)
            stats = engine.stats()
            assert stats.promoted_chunks == 2  # chunks 2 and 3: the one holding token 35 on
            assert stats.pinned_chunks == 2
            await engine.lookup_unpin("r1")


@pytest.mark.anyio
async def test_a_full_pool_promises_what_could_be_reserved_without_waiting_for_room(
    tmp_path: Path,
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            await store(engine, 64)
        async with engine_on(tmp_path, allocation_timeout=60) as engine:
            pool = engine._parts.pool
            held = []
            while (obj := pool.allocate_nowait((pool.page_size,), torch.uint8)) is not None:
                held.append(obj)  # the pool is full of memory nobody may evict
            try:
                with anyio.fail_after(20):  # far below the 60 s a wait for room would take
                    assert await settled(engine, 64, "r1") == Promise(0, False)
                assert engine.stats().pinned_chunks == 0
            finally:
                for obj in held:
                    obj.unref()
            assert engine.stats().pool.used_bytes == 0


@pytest.mark.anyio
async def test_a_promise_of_nothing_is_asked_afresh(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path, local_disk=None) as engine:
            assert await engine.promise(tokens_of(64, 1), lookup_id="r1") == Promise(0, False)
            await store(engine, 64)  # stored since (a preempted request asks again)
            assert await engine.promise(tokens_of(64, 1), lookup_id="r1") == Promise(64, False)
            await engine.lookup_unpin("r1")
            assert engine.stats().pinned_chunks == 0


CHUNK_BYTES = math.prod(layout().payload_shape(CHUNK)) * layout().dtype.itemsize
PAGE = page_size_for(CHUNK_BYTES)  # the pool's page: each chunk here takes one


@pytest.mark.anyio
async def test_promises_past_a_tenants_cpu_quota_stop_short_and_leave_others_room(
    tmp_path: Path,
) -> None:
    """A tenant with a 2-chunk CPU quota asks for promises of 4 prompts of 2 chunks on disk
    (the whole pool of 8): the first is promised in full, the others stop short (nothing
    more may be pinned for the tenant), counted; another tenant within its quota stores."""
    quotas = {"a": 2 * (CHUNK_BYTES + 64) / GB, "b": 4 * (CHUNK_BYTES + 64) / GB}
    options = {
        "max_local_cpu_size": 8 * PAGE / GB,
        "allocation_timeout": 1.0,
        "tenant_quotas": {"cpu": quotas},
    }
    n = 2 * CHUNK
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path, **options) as engine:
            for seed in range(10, 14):
                assert await store(engine, n, seed, tenant="a", store_location=["disk"]) == n
            promises = [await settled(engine, n, f"r{seed}", seed, "a") for seed in range(10, 14)]
            assert promises == [Promise(n, False)] + [Promise(0, False)] * 3
            stats = engine.stats()
            assert stats.pinned_chunks == 2
            assert stats.promise_shortfall_tokens == 3 * n
            assert engine.tenant_stats("a").pins_refused == 3 * 2
            assert engine.tenant_stats("a").tiers["cpu"].bytes <= 2 * (CHUNK_BYTES + 64)
            assert await store(engine, 3 * CHUNK, 20, tenant="b") == 3 * CHUNK
            await retrieve(engine, 3 * CHUNK, 3 * CHUNK, 20, tenant="b")
            await retrieve(engine, n, n, 10, tenant="a", lookup_id="r10")
