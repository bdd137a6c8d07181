"""CacheEngine over the disk tier: restart (in-process and across processes), prefixes that
span tiers, promotion, prefetch, search ranges, clear by location, hot cache off, freeze,
asymmetric locations with remove-after-retrieve, corruption, and a disk that cannot hold a
chunk. Every retrieve is checked bit for bit against the source KV."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import lmcache_async.core.load as load_module
from lmcache_async import (
    CacheEngine,
    ConfigError,
    EngineClosedError,
    EngineConfig,
    InvalidInputError,
    KVLayout,
)

CHUNK = 16
BLOCK = 16
NUM_BLOCKS = 64
NUM_SLOTS = NUM_BLOCKS * BLOCK
TIMEOUT = 30
HERE = Path(__file__).parent


def layout() -> KVLayout:
    return KVLayout.vllm_flash_attn(
        num_layers=2, block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16
    )


def tokens_of(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, 30_000, (n,), generator=gen)]


def source_caches(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return layout().allocate_kv_caches(NUM_BLOCKS, generator=gen, random=True)


def slots_of(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(NUM_SLOTS, generator=gen)[:n].to(torch.int64)


def token_kv(caches: list[torch.Tensor], slot: int) -> torch.Tensor:
    """All layers' K and V of one slot, as int16 bits."""
    return torch.stack(
        [layer[:, slot // BLOCK, slot % BLOCK].view(torch.int16) for layer in caches]
    )


def assert_loaded_exactly(
    source: list[torch.Tensor],
    target: list[torch.Tensor],
    slots: torch.Tensor,
    mask: torch.Tensor,
    expected_tokens: int,
) -> None:
    assert int(mask.sum()) == expected_tokens
    assert bool(mask[:expected_tokens].all())
    for i in range(expected_tokens):
        slot = int(slots[i])
        assert torch.equal(token_kv(target, slot), token_kv(source, slot)), f"token {i}"
    for i in range(expected_tokens, len(mask)):
        slot = int(slots[i])
        assert not torch.any(token_kv(target, slot)), f"token {i} was written"


def config(directory: Path, **overrides: Any) -> EngineConfig:
    values: dict[str, Any] = {
        "chunk_size": CHUNK,
        "max_local_cpu_size": 0.01,
        "local_disk": str(directory),
        "max_local_disk_size": 0.05,
    }
    values.update(overrides)
    return EngineConfig(**values)


@asynccontextmanager
async def engine_on(directory: Path, **overrides: Any) -> AsyncIterator[CacheEngine]:
    async with CacheEngine.open(
        config(directory, **overrides), layout(), model_name="tiers-test"
    ) as engine:
        yield engine


async def store(engine: CacheEngine, n: int, seed: int = 1, **kw: Any) -> int:
    stored = await engine.store(
        tokens_of(n, seed), kv_caches=source_caches(seed), slot_mapping=slots_of(n, seed), **kw
    )
    assert await engine.flush()
    return stored


async def retrieve(engine: CacheEngine, n: int, expected: int, seed: int = 1, **kw: Any) -> None:
    target = [torch.zeros_like(t) for t in source_caches(seed)]
    slots = slots_of(n, seed)
    mask = await engine.retrieve(tokens_of(n, seed), kv_caches=target, slot_mapping=slots, **kw)
    assert_loaded_exactly(source_caches(seed), target, slots, mask, expected)


def chunk_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.chunk"))


@pytest.mark.anyio
async def test_restart_hits_what_an_earlier_engine_stored(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            assert await store(engine, 100) == 100
            assert engine.stats().tiers["disk"].chunks == 7
        async with engine_on(tmp_path) as engine:
            assert engine.stats().tiers["cpu"].chunks == 0
            assert await engine.lookup(tokens_of(100, 1)) == 100
            await retrieve(engine, 100, 100)
            stats = engine.stats()
            assert stats.promoted_chunks == 7
            assert stats.tiers["cpu"].chunks == 7
            assert stats.pool.used_bytes > 0
        assert stats.tier_health == {"cpu": True, "disk": True}


@pytest.mark.anyio
async def test_an_engine_waits_for_its_disk_index_and_counts_every_file(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            assert await store(engine, 100) == 100
        files = len(chunk_files(tmp_path))
        async with engine_on(tmp_path) as engine:
            assert await engine.wait_disk_index(audited=True)
            assert engine.stats().tiers["disk"].chunks == files == 7
        async with CacheEngine.open(
            EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01), layout(), model_name="m"
        ) as engine:
            assert await engine.wait_disk_index()  # no disk tier: nothing to wait for
        with pytest.raises(EngineClosedError):
            await engine.wait_disk_index()


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_restart_in_another_process_is_bit_exact(tmp_path: Path) -> None:
    script = HERE / "tier_store_script.py"
    with anyio.fail_after(120):
        done = await anyio.run_process(
            [sys.executable, str(script), str(tmp_path), "80", "7"], check=False
        )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip().splitlines()[-1] == "stored 80"
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            await retrieve(engine, 80, 80, seed=7)


@pytest.mark.anyio
async def test_prefix_that_begins_on_disk_and_continues_in_cpu(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            await store(engine, 96, store_location=["disk"])
            await store(engine, 96, store_location=["cpu"])
            # Drop the first two chunks from the CPU tier only.
            keys = [s.key for s in engine.key_hasher.spans(tokens_of(96, 1))]
            assert await engine._parts.manager.remove(keys[:2], ["cpu"]) == 2
            assert engine.stats().tiers["cpu"].chunks == 4
            assert await engine.lookup(tokens_of(96, 1), search_range=["cpu"]) == 0
            assert await engine.lookup(tokens_of(96, 1)) == 96
            await retrieve(engine, 96, 96)


@pytest.mark.anyio
async def test_search_range_and_clear_by_location(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            await store(engine, 64)
            assert await engine.clear(locations=["cpu"]) == 4
            prompt = tokens_of(64, 1)
            assert await engine.lookup(prompt, search_range=["cpu"]) == 0
            assert await engine.lookup(prompt, search_range=["disk"]) == 64
            await retrieve(engine, 64, 0, retrieve_locations=["cpu"])
            await retrieve(engine, 64, 64, retrieve_locations=["disk"])
            # Read from disk only: nothing was promoted into the CPU tier.
            assert engine.stats().tiers["cpu"].chunks == 0
            assert await engine.clear() == 4
            assert chunk_files(tmp_path) == []
            with pytest.raises(InvalidInputError, match="redis"):
                await engine.lookup(prompt, search_range=["redis"])


@pytest.mark.anyio
async def test_prefetch_loads_disk_hits_for_the_retrieve(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            await store(engine, 70)
        async with engine_on(tmp_path, local_cpu=False) as engine:
            assert await engine.prefetch(tokens_of(70, 1), lookup_id="r1") == 70
            await retrieve(engine, 70, 70, lookup_id="r1")
            stats = engine.stats()
            assert stats.pinned_chunks == 0
            assert stats.tiers["cpu"].chunks == 0  # hot cache off: nothing kept
            assert stats.pool.used_bytes == 0


@pytest.mark.anyio
async def test_hot_cache_off_writes_disk_only(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path, local_cpu=False) as engine:
            assert await store(engine, 50) == 50
            stats = engine.stats()
            assert stats.tiers["cpu"].chunks == 0
            assert stats.tiers["disk"].chunks == 4
            assert stats.pool.used_bytes == 0
            await retrieve(engine, 50, 50)


@pytest.mark.anyio
async def test_freeze_reads_the_cpu_tier_only(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            await store(engine, 48)
        async with engine_on(tmp_path) as engine:
            engine.freeze(True)
            assert await engine.lookup(tokens_of(48, 1)) == 0
            await retrieve(engine, 48, 0)
            assert (
                await engine.store(
                    tokens_of(48, 2), kv_caches=source_caches(2), slot_mapping=slots_of(48, 2)
                )
                == 0
            )
            engine.freeze(False)
            assert await engine.lookup(tokens_of(48, 1)) == 48


@pytest.mark.anyio
async def test_sender_and_receiver_roles(tmp_path: Path) -> None:
    """Disaggregated prefill: the sender writes disk only; the receiver removes what it
    loaded."""
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path, store_location=["disk"]) as sender:
            assert await store(sender, 64) == 64
            assert sender.stats().tiers["cpu"].chunks == 0
        async with engine_on(
            tmp_path, retrieve_locations=["disk"], remove_after_retrieve=True, local_cpu=False
        ) as receiver:
            await retrieve(receiver, 64, 64)
            assert await receiver.lookup(tokens_of(64, 1)) == 0
            assert chunk_files(tmp_path) == []


@pytest.mark.anyio
async def test_corrupt_file_is_a_miss_never_wrong_bytes(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            await store(engine, 64)
        async with engine_on(tmp_path) as engine:
            third = engine.key_hasher.spans(tokens_of(64, 1))[2].key.to_str()
            (victim,) = [p for p in chunk_files(tmp_path) if p.name.startswith(third)]
            data = bytearray(victim.read_bytes())
            data[-5] ^= 0x40
            victim.write_bytes(bytes(data))
            await retrieve(engine, 64, 32)
            assert engine.stats().tiers["disk"].corrupt == 1
            assert not victim.exists()


@pytest.mark.anyio
async def test_disk_too_small_for_a_chunk_fails_only_the_disk_write(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path, max_local_disk_size=1e-6) as engine:
            assert await store(engine, 32) == 32
            stats = engine.stats()
            assert stats.tiers["disk"].chunks == 0
            assert stats.tiers["cpu"].chunks == 2
            await retrieve(engine, 32, 32)


@pytest.mark.anyio
async def test_bad_tier_settings_name_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(remote_url="http://localhost:1")
    assert info.value.field == "remote_url"
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError) as info:
        async with engine_on(blocker / "cache"):
            pass
    assert info.value.field == "local_disk"
    with pytest.raises(ConfigError) as info:
        CacheEngine(config(tmp_path, store_location=["redis"]), layout(), model_name="m")
    assert info.value.field == "store_location"


@pytest.mark.anyio
async def test_disk_writes_happen_behind_the_store(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            n = 64
            stored = await engine.store(
                tokens_of(n, 1), kv_caches=source_caches(1), slot_mapping=slots_of(n, 1)
            )
            assert stored == n
            assert await engine.flush()
            assert engine.stats().tier_writes_pending == 0
            assert len(chunk_files(tmp_path)) == 4
        assert os.listdir(tmp_path)  # the cache outlives the engine


@pytest.mark.anyio
async def test_compress_and_decompress_in_place_on_disk(tmp_path: Path) -> None:
    from lmcache_async.backends.record import RecordHeader

    def codecs() -> set[str]:
        return {RecordHeader.from_bytes(p.read_bytes())[0].codec for p in chunk_files(tmp_path)}

    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path, local_cpu=False) as engine:
            await store(engine, 64)
            assert codecs() == {"none"}
            engine.take_events()
            assert await engine.compress(tokens_of(64, 1), "zstd", "disk") == 4
            assert codecs() == {"zstd"}
            assert engine.take_events() == [], "re-encoded chunks stay: nothing is removed"
            await retrieve(engine, 64, 64)
            assert await engine.decompress(tokens_of(64, 1), "disk") == 4
            assert codecs() == {"none"}
            await retrieve(engine, 64, 64)
            with pytest.raises(InvalidInputError, match="codec"):
                await engine.compress(tokens_of(64, 1), "gzip", "disk")
            with pytest.raises(InvalidInputError, match="cpu"):
                await engine.compress(tokens_of(64, 1), "zstd", "cpu")
            # int8 is lossy: what comes back is close, within the codec's bound.
            assert await engine.compress(tokens_of(64, 1), "int8", "disk") == 4
            target = [torch.zeros_like(t) for t in source_caches(1)]
            slots = slots_of(64, 1)
            mask = await engine.retrieve(tokens_of(64, 1), kv_caches=target, slot_mapping=slots)
            assert bool(mask.all())
            source = source_caches(1)
            worst = max(
                float(
                    (t[:, s // BLOCK, s % BLOCK].float() - r[:, s // BLOCK, s % BLOCK].float())
                    .abs()
                    .max()
                )
                for t, r in zip(target, source, strict=True)
                for s in slots.tolist()
            )
            assert 0 < worst < 0.05 * max(float(r.abs().max()) for r in source)
            assert engine.stats().pool.used_bytes == 0


@pytest.mark.anyio
async def test_a_retrieve_from_disk_reads_in_small_batches_after_the_ram_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks held in RAM are reserved in one batch; those only the disk holds in batches
    of ``SLOW_READ_BATCH_BYTES`` (two chunks here), each copied out while the next is read;
    every byte is exact."""
    chunk_bytes = layout().token_bytes * CHUNK
    monkeypatch.setattr(load_module, "SLOW_READ_BATCH_BYTES", 2 * chunk_bytes)
    reserved: list[int] = []
    reserve = load_module.LoadCore.reserve

    async def counted(self: Any, keys: Any, *args: Any, **kw: Any) -> Any:
        reserved.append(len(keys))
        return await reserve(self, keys, *args, **kw)

    monkeypatch.setattr(load_module.LoadCore, "reserve", counted)
    with anyio.fail_after(TIMEOUT):
        async with engine_on(tmp_path) as engine:
            assert await store(engine, 7 * CHUNK) == 7 * CHUNK
            await engine.clear(["cpu"])
            assert await store(engine, 2 * CHUNK) == 2 * CHUNK  # the first two in RAM again
            await retrieve(engine, 7 * CHUNK, 7 * CHUNK)
    assert reserved == [2, 2, 2, 1]
