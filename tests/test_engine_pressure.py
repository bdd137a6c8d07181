"""CacheEngine under memory pressure: a CPU tier smaller than the working set.

Stores become partial (a prefix), old chunks are evicted least-recently-used first, pinned
chunks are never evicted, and concurrent stores and retrieves neither deadlock nor load a
single wrong bit.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from lmcache_async import CacheEngine, EngineConfig, EventKind, KVLayout

CHUNK = 16
BLOCK_SIZE = 16
NUM_HEADS = 2
HEAD_SIZE = 8
LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=2, block_size=BLOCK_SIZE, num_kv_heads=NUM_HEADS, head_size=HEAD_SIZE,
    dtype=torch.float32,
)  # fmt: skip
MAX_PROMPT_CHUNKS = 5
NUM_PROMPTS = 32
SLOTS_PER_PROMPT = MAX_PROMPT_CHUNKS * CHUNK
NUM_BLOCKS = NUM_PROMPTS * SLOTS_PER_PROMPT // BLOCK_SIZE


def token_kv(layer: torch.Tensor, slot: int) -> torch.Tensor:
    """The ``[2, H, D]`` K/V of the token at ``slot`` (a view)."""
    block, offset = divmod(slot, BLOCK_SIZE)
    return layer[:, block, offset]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def caches(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return LAYOUT.allocate_kv_caches(NUM_BLOCKS, generator=gen, random=True)


@asynccontextmanager
async def engine_with_room_for(
    chunks: int, chunk_bytes: int, **overrides: Any
) -> AsyncIterator[CacheEngine]:
    # Half a chunk of slack so float rounding of the GB figure cannot lose a page.
    size_gb = (chunks * chunk_bytes + chunk_bytes // 2) / 1024**3
    values: dict[str, Any] = {"chunk_size": CHUNK, "max_local_cpu_size": size_gb}
    values.update(overrides)
    async with CacheEngine.open(EngineConfig(**values), LAYOUT, model_name="pressure") as engine:
        assert engine.stats().pool.capacity_bytes // chunk_bytes == chunks
        yield engine


async def measure_chunk_bytes() -> int:
    """Pool bytes one cached chunk holds (its payload rounded up to whole pages)."""
    config = EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01)
    source = caches(1)
    async with CacheEngine.open(config, LAYOUT, model_name="probe") as engine:
        stored = await engine.store(
            list(range(CHUNK)), kv_caches=source, slot_mapping=torch.arange(CHUNK)
        )
        assert stored == CHUNK
        used = engine.stats().pool.used_bytes
    assert used >= CHUNK * LAYOUT.token_bytes
    return used


class Prompts:
    """Distinct prompts whose KV sits in one source cache, each in its own slot range."""

    def __init__(self, seed: int, count: int = NUM_PROMPTS, chunks: int | None = None) -> None:
        rng = random.Random(seed)
        self.source = caches(seed)
        self.tokens: list[list[int]] = []
        self.slots: list[torch.Tensor] = []
        for i in range(count):
            n_chunks = chunks or rng.randint(1, MAX_PROMPT_CHUNKS)
            n = n_chunks * CHUNK - (rng.randint(0, CHUNK - 1) if chunks is None else 0)
            # The first token differs between prompts, so no two share a chunk.
            self.tokens.append([100_000 + i] + [rng.randrange(50_000) for _ in range(n - 1)])
            base = i * SLOTS_PER_PROMPT
            perm = torch.randperm(SLOTS_PER_PROMPT, generator=torch.Generator().manual_seed(i))
            self.slots.append(perm[:n].to(torch.int64) + base)

    async def store(self, engine: CacheEngine, i: int) -> int:
        return await engine.store(self.tokens[i], kv_caches=self.source, slot_mapping=self.slots[i])


def assert_prefix_mask(mask: torch.Tensor, n: int) -> int:
    """``mask`` is True on a run from token 0 of whole chunks (or to the end); its length."""
    assert mask.dtype == torch.bool
    assert mask.shape == (n,)
    loaded = int(mask.sum())
    assert mask[:loaded].all()
    assert loaded == n or loaded % CHUNK == 0
    return loaded


async def storm(engine: CacheEngine, prompts: Prompts, seed: int) -> tuple[dict[int, int], int]:
    """Run a store of every prompt and as many retrieves, all at once (64 tasks).

    Half the retrieves race their prompt's store, half start once it returned. Checks that
    every store kept a prefix, every retrieve loaded a chunk-aligned prefix bit for bit as
    stored, and that no slot outside the loaded tokens was written. Returns the tokens each
    store reported cached and the total tokens loaded.
    """
    rng = random.Random(seed)
    target = caches(seed)
    sentinel = [t.clone() for t in target]
    # Each retrieve writes into its own slot range of the shared target cache.
    order = [rng.randrange(NUM_PROMPTS) for _ in range(NUM_PROMPTS)]
    dst_slots = [
        (torch.randperm(SLOTS_PER_PROMPT, generator=torch.Generator().manual_seed(seed + j))
         [: len(prompts.tokens[p])] + j * SLOTS_PER_PROMPT)
        for j, p in enumerate(order)
    ]  # fmt: skip
    stored: dict[int, int] = {}
    loaded: dict[int, torch.Tensor] = {}
    done = [anyio.Event() for _ in range(NUM_PROMPTS)]

    async def do_store(i: int) -> None:
        stored[i] = await prompts.store(engine, i)
        done[i].set()

    async def do_retrieve(j: int) -> None:
        p = order[j]
        if j % 2:
            await done[p].wait()
        loaded[j] = await engine.retrieve(
            prompts.tokens[p], kv_caches=target, slot_mapping=dst_slots[j]
        )

    async with anyio.create_task_group() as tg:
        for k in range(NUM_PROMPTS):
            tg.start_soon(do_store, k)
            tg.start_soon(do_retrieve, k)

    assert len(stored) == len(loaded) == NUM_PROMPTS
    for i, n in stored.items():
        total = len(prompts.tokens[i])
        assert 0 <= n <= total
        assert n == total or n % CHUNK == 0

    expected = [t.clone() for t in sentinel]
    loaded_tokens = 0
    for j, mask in loaded.items():
        p = order[j]
        n_loaded = assert_prefix_mask(mask, len(prompts.tokens[p]))
        loaded_tokens += n_loaded
        for t in range(n_loaded):
            src = int(prompts.slots[p][t])
            dst = int(dst_slots[j][t])
            for exp_layer, src_layer in zip(expected, prompts.source, strict=True):
                token_kv(exp_layer, dst).copy_(token_kv(src_layer, src))
    for layer, (got, want) in enumerate(zip(target, expected, strict=True)):
        assert same_bits(got, want), f"layer {layer}: retrieved bytes differ"
    return stored, loaded_tokens


async def settle(engine: CacheEngine) -> None:
    """Wait (bounded) until the pool holds the cached chunks and nothing else."""
    with anyio.fail_after(10):
        while True:
            s = engine.stats()
            if s.pool.num_objects == s.cached_chunks and s.pool.waiters == 0:
                return
            await anyio.sleep(0.005)


@pytest.mark.anyio
@pytest.mark.slow
async def test_concurrent_stores_and_retrieves_under_pressure() -> None:
    chunk_bytes = await measure_chunk_bytes()
    capacity = 8
    prompts = Prompts(seed=7)
    with anyio.fail_after(60):
        async with engine_with_room_for(
            capacity, chunk_bytes, allocation_timeout=0.3, pipeline_queue_size=2
        ) as engine:
            stored, loaded_tokens = await storm(engine, prompts, seed=8)
            assert loaded_tokens > 0, "no retrieve hit: the test proves nothing"
            await settle(engine)
            s = engine.stats()
            assert s.cached_chunks <= capacity
            assert s.pool.used_bytes == s.cached_chunks * chunk_bytes
            assert s.pinned_chunks == 0
            assert s.store_requests == NUM_PROMPTS
            assert s.retrieve_requests == NUM_PROMPTS
            assert s.retrieved_tokens == loaded_tokens
            assert sum(-(-n // CHUNK) for n in stored.values()) > capacity
            assert s.evicted_chunks > 0
            hits = [await engine.lookup(t) for t in prompts.tokens]
            assert sum(-(-h // CHUNK) for h in hits) <= s.cached_chunks
            assert await engine.clear() == s.cached_chunks
            assert engine.stats().pool.used_bytes == 0


@pytest.mark.anyio
@pytest.mark.slow
async def test_concurrent_requests_with_most_memory_pinned_go_partial() -> None:
    """Pinned chunks fill most of the tier: concurrent stores end partial (never hang) and
    the pinned prompt stays intact."""
    chunk_bytes = await measure_chunk_bytes()
    capacity = 7
    held = Prompts(seed=29, count=1, chunks=5)
    prompts = Prompts(seed=31)
    with anyio.fail_after(60):
        async with engine_with_room_for(
            capacity, chunk_bytes, allocation_timeout=0.05, pipeline_batch_chunks=4
        ) as engine:
            assert await held.store(engine, 0) == 5 * CHUNK
            assert await engine.lookup(held.tokens[0], lookup_id="held", pin=True) == 5 * CHUNK
            stored, _ = await storm(engine, prompts, seed=32)
            s = engine.stats()
            assert s.partial_stores > 0
            assert any(n < len(prompts.tokens[i]) for i, n in stored.items())
            assert s.pinned_chunks == 5
            await settle(engine)
            # The pinned prompt survived the storm, bit for bit.
            target = caches(33)
            mask = await engine.retrieve(
                held.tokens[0], kv_caches=target, slot_mapping=held.slots[0], lookup_id="held"
            )
            assert bool(mask.all())
            for got, src in zip(target, held.source, strict=True):
                for slot in held.slots[0].tolist():
                    assert same_bits(token_kv(got, slot), token_kv(src, slot))
            assert engine.stats().pinned_chunks == 0
            await engine.clear()
            assert engine.stats().pool.used_bytes == 0


@pytest.mark.anyio
async def test_lru_keeps_the_most_recent_prompts() -> None:
    chunk_bytes = await measure_chunk_bytes()
    capacity = 8
    prompts = Prompts(seed=11, count=12, chunks=2)
    with anyio.fail_after(30):
        async with engine_with_room_for(capacity, chunk_bytes, allocation_timeout=2.0) as engine:
            for i in range(12):
                assert await prompts.store(engine, i) == 2 * CHUNK
                assert engine.stats().cached_chunks <= capacity
            hits = [await engine.lookup(prompts.tokens[i]) for i in range(12)]
            # Room for 4 prompts of 2 chunks: 8..11 survive, 0..7 were evicted.
            assert hits[8:] == [2 * CHUNK] * 4
            assert hits[:7] == [0] * 7
            assert engine.stats().evicted_chunks >= 16
            # Using prompt 8 makes it recent: the next store evicts prompt 9 instead.
            target = caches(12)
            mask = await engine.retrieve(
                prompts.tokens[8], kv_caches=target, slot_mapping=prompts.slots[8]
            )
            assert bool(mask.all())
            fresh = Prompts(seed=13, count=13, chunks=2)
            fresh.source = prompts.source
            assert await fresh.store(engine, 12) == 2 * CHUNK
            assert await engine.lookup(prompts.tokens[8]) == 2 * CHUNK
            assert await engine.lookup(prompts.tokens[9]) == 0
            assert await engine.lookup(prompts.tokens[11]) == 2 * CHUNK
            await engine.clear()
            assert engine.stats().pool.used_bytes == 0


@pytest.mark.anyio
async def test_pinned_chunks_are_never_evicted_and_stores_go_partial() -> None:
    chunk_bytes = await measure_chunk_bytes()
    capacity = 6
    prompts = Prompts(seed=17, count=4, chunks=4)
    with anyio.fail_after(30):
        async with engine_with_room_for(capacity, chunk_bytes, allocation_timeout=0.2) as engine:
            assert await prompts.store(engine, 0) == 4 * CHUNK
            assert await engine.lookup(prompts.tokens[0], lookup_id="keep", pin=True) == 4 * CHUNK
            assert engine.stats().pinned_chunks == 4
            # Only 2 chunks of room are left and the 4 pinned ones cannot be evicted.
            n = await prompts.store(engine, 1)
            assert n < 4 * CHUNK
            assert n % CHUNK == 0
            assert await engine.lookup(prompts.tokens[1]) == n
            assert engine.stats().partial_stores >= 1
            assert await engine.lookup(prompts.tokens[0]) == 4 * CHUNK
            s = engine.stats()
            assert s.pool.used_bytes <= s.pool.capacity_bytes
            assert s.pool.waiters == 0
            # Releasing the pin lets later stores evict the old prompt.
            await engine.lookup_unpin("keep")
            assert engine.stats().pinned_chunks == 0
            assert await prompts.store(engine, 2) == 4 * CHUNK
            assert await prompts.store(engine, 3) == 4 * CHUNK
            assert await engine.lookup(prompts.tokens[0]) == 0
            await engine.clear()
            assert engine.stats().pool.used_bytes == 0


@pytest.mark.anyio
async def test_store_into_a_fully_pinned_pool_times_out_to_zero() -> None:
    chunk_bytes = await measure_chunk_bytes()
    capacity = 4
    prompts = Prompts(seed=19, count=2, chunks=4)
    with anyio.fail_after(30):
        async with engine_with_room_for(capacity, chunk_bytes, allocation_timeout=0.2) as engine:
            assert await prompts.store(engine, 0) == 4 * CHUNK
            assert await engine.lookup(prompts.tokens[0], lookup_id="all", pin=True) == 4 * CHUNK
            with anyio.fail_after(5):  # bounded by allocation_timeout, not a hang
                assert await prompts.store(engine, 1) == 0
            assert await engine.lookup(prompts.tokens[1]) == 0
            s = engine.stats()
            assert s.partial_stores >= 1
            assert s.pool.num_objects == 4
            assert s.pool.waiters == 0
            await engine.lookup_unpin("all")
            assert await prompts.store(engine, 1) == 4 * CHUNK


@pytest.mark.anyio
async def test_eviction_frees_only_what_is_needed() -> None:
    """A full tier evicts one old chunk per new chunk, not everything it holds."""
    chunk_bytes = await measure_chunk_bytes()
    capacity = 8
    prompts = Prompts(seed=23, count=capacity + 3, chunks=1)
    with anyio.fail_after(30):
        async with engine_with_room_for(capacity, chunk_bytes) as engine:
            for i in range(capacity):
                assert await prompts.store(engine, i) == CHUNK
            assert engine.stats().cached_chunks == capacity
            for extra in range(1, 4):
                assert await prompts.store(engine, capacity + extra - 1) == CHUNK
                s = engine.stats()
                assert s.cached_chunks == capacity
                assert s.evicted_chunks == extra
            hits = [await engine.lookup(t) for t in prompts.tokens]
            assert hits == [0] * 3 + [CHUNK] * capacity


@pytest.mark.anyio
async def test_a_store_into_a_full_tier_evicts_for_all_its_chunks_at_once() -> None:
    """A store of k new chunks into a full tier evicts the k least recently used in one
    pass: one removal event naming exactly the oldest prompt's chunks, nothing else."""
    chunk_bytes = await measure_chunk_bytes()
    prompts = Prompts(seed=17, count=3, chunks=4)
    with anyio.fail_after(30):
        async with engine_with_room_for(
            8, chunk_bytes, allocation_timeout=2.0, enable_kv_events=True
        ) as engine:
            assert await prompts.store(engine, 0) == 4 * CHUNK
            assert await prompts.store(engine, 1) == 4 * CHUNK
            stored = [e for e in engine.take_events() if e.kind is EventKind.STORED]
            assert await prompts.store(engine, 2) == 4 * CHUNK
            events = engine.take_events()
            assert engine.stats().evicted_chunks == 4
            assert await engine.lookup(prompts.tokens[0]) == 0
            assert await engine.lookup(prompts.tokens[1]) == 4 * CHUNK
    removed = [event for event in events if event.kind is EventKind.REMOVED]
    assert len(removed) == 1, events
    assert removed[0].block_hashes == stored[0].block_hashes
