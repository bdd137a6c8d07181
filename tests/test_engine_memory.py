"""Host memory through the engine: the pool's page is the chunk's size, so a 4 KiB chunk
takes 4 KiB of ``max_local_cpu_size`` (a short last chunk one page), everything returns to
the pool after a clear and at close, and the KV events of a store carry its exact tokens
whatever the caller does with its list or array afterwards."""

from __future__ import annotations

import sys
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from lmcache_async import CacheEngine, EngineConfig, KVLayout
from lmcache_async.config import GB

pytestmark = pytest.mark.anyio

CHUNK = 16
CHUNK_BYTES = 4096  # K and V x 1 layer x 16 tokens x 64 x fp16
BLOCKS = 32
TIMEOUT = 20
LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=1, block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16
)


def config(**overrides: Any) -> EngineConfig:
    values: dict[str, Any] = {"chunk_size": CHUNK, "max_local_cpu_size": 0.001}
    values.update(overrides)
    return EngineConfig(**values)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def slots(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64)


def caches(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return LAYOUT.allocate_kv_caches(BLOCKS, generator=gen, random=True)


async def test_a_4_kib_chunk_takes_4_kib_and_a_short_last_chunk_one_page() -> None:
    n = 2 * CHUNK + 5
    source, target = caches(1), [torch.zeros_like(t) for t in caches(2)]
    prompt = tokens(n, seed=3)
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(config(), LAYOUT, model_name="m") as engine:
            pool = engine.core.pool
            assert pool.page_size == CHUNK_BYTES
            assert await engine.store(prompt, kv_caches=source, slot_mapping=slots(n)) == n
            stats = engine.stats()
            assert (stats.pool.used_bytes, stats.pool.num_objects) == (3 * CHUNK_BYTES, 3)
            assert stats.tiers["cpu"].bytes == 2 * CHUNK_BYTES + 5 * CHUNK_BYTES // CHUNK
            loaded = await engine.retrieve(prompt, kv_caches=target, slot_mapping=slots(n))
            assert loaded.all()
            for src, dst in zip(source, target, strict=True):
                rows = src.view(torch.int16).view(2, -1, 64)
                back = dst.view(torch.int16).view(2, -1, 64)
                assert torch.equal(back[:, :n], rows[:, :n])  # K and V of slot i: row i
                assert not back[:, n:].any()
            assert engine.stats().pool.used_bytes == 3 * CHUNK_BYTES  # references returned
            assert await engine.clear() == 3
            assert (engine.stats().pool.used_bytes, engine.stats().pool.num_objects) == (0, 0)
            assert await engine.store(prompt, kv_caches=source, slot_mapping=slots(n)) == n
        assert pool.closed
        assert (pool.stats().used_bytes, pool.stats().num_objects) == (0, 0)


async def test_one_mib_of_cpu_tier_holds_256_chunks_of_4_kib() -> None:
    """Not 16, as when every chunk took a 64 KiB page."""
    prompt_chunks = BLOCKS * 16 // CHUNK
    source = caches(4)
    with anyio.fail_after(TIMEOUT):
        settings = config(max_local_cpu_size=(1 << 20) / GB)
        async with CacheEngine.open(settings, LAYOUT, model_name="m") as engine:
            prompts = [tokens(prompt_chunks * CHUNK, seed=10 + i) for i in range(8)]
            for prompt in prompts:
                stored = await engine.store(
                    prompt, kv_caches=source, slot_mapping=slots(len(prompt))
                )
                assert stored == len(prompt)
            stats = engine.stats()
            assert stats.pool.capacity_bytes == 1 << 20
            assert stats.tiers["cpu"].chunks == 256  # capacity / 4 KiB
            assert stats.tiers["cpu"].evictions == 0
            for prompt in prompts:
                assert await engine.lookup(prompt) == len(prompt)


async def test_events_carry_the_stored_tokens_after_the_caller_changes_its_list_or_array() -> None:
    n = 2 * CHUNK
    source = caches(5)
    as_list = tokens(n, seed=6)
    as_array = np.array(tokens(n, seed=7), dtype=np.int32)  # shared with the engine's view
    expected = [list(as_list), as_array.tolist()]
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(config(), LAYOUT, model_name="m") as engine:
            assert await engine.store(as_list, kv_caches=source, slot_mapping=slots(n)) == n
            assert await engine.store(as_array, kv_caches=source, slot_mapping=slots(n)) == n
            as_list[:] = [1] * n
            as_array[:] = 1
            events = engine.take_events()
    assert [list(e.token_ids) for e in events] == expected
    assert all(e.kind == "stored" and len(e.block_hashes) == 2 for e in events)


def rss_bytes() -> int:
    """This process's resident memory (``VmRSS``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, madvise")


@linux_only
@pytest.mark.parametrize("prefault", [True, False])
async def test_the_pool_is_faulted_in_behind_the_start_only_when_asked(prefault: bool) -> None:
    size = 512 << 20
    with anyio.fail_after(TIMEOUT * 3):
        before = rss_bytes()
        settings = config(max_local_cpu_size=size / GB, prefault_pool=prefault)
        async with CacheEngine.open(settings, LAYOUT, model_name="m") as engine:
            worker = engine.core.pool.prefaulting
            if prefault:
                assert worker is not None
                assert await anyio.to_thread.run_sync(worker.join, TIMEOUT * 2)
                assert worker.faulted_bytes == size
                assert rss_bytes() - before > 0.9 * size
            else:
                assert worker is None
                assert rss_bytes() - before < size // 4
        if worker is not None:
            assert not worker.running


@linux_only
async def test_stores_and_retrieves_keep_exact_bytes_while_the_pool_faults_in() -> None:
    n = BLOCKS * 16
    source = caches(11)
    with anyio.fail_after(TIMEOUT * 3):
        settings = config(max_local_cpu_size=(256 << 20) / GB, prefault_pool=True)
        async with CacheEngine.open(settings, LAYOUT, model_name="m") as engine:
            assert engine.core.pool.prefaulting is not None
            for seed in range(8):
                prompt = tokens(n, seed=100 + seed)
                assert await engine.store(prompt, kv_caches=source, slot_mapping=slots(n)) == n
                target = [torch.zeros_like(t) for t in source]
                loaded = await engine.retrieve(prompt, kv_caches=target, slot_mapping=slots(n))
                assert loaded.all()
                for src, dst in zip(source, target, strict=True):
                    assert torch.equal(src, dst)
