"""SyncCacheEngine: the synchronous facade, used from plain threads."""

from __future__ import annotations

import threading

import pytest
import torch

from lmcache_async import (
    EngineClosedError,
    EngineConfig,
    InvalidInputError,
    KVLayout,
    SyncCacheEngine,
)

CHUNK = 16
BLOCK_SIZE = 16
NUM_BLOCKS = 32
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE
LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=2, block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.bfloat16
)


def config() -> EngineConfig:
    return EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01)


def caches(seed: int) -> list[torch.Tensor]:
    return LAYOUT.allocate_kv_caches(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))


def token_kv(layer: torch.Tensor, slot: int) -> torch.Tensor:
    block, offset = divmod(slot, BLOCK_SIZE)
    return layer[:, block, offset]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def round_trip(engine: SyncCacheEngine, seed: int, n: int) -> None:
    """Store a fresh prompt, retrieve it into a sentinel-filled cache, check every bit."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [seed * 1_000_000 + int(t) for t in torch.randint(0, 50_000, (n,), generator=gen)]
    source = caches(seed)
    target = caches(seed + 1)
    src_slots = torch.randperm(NUM_SLOTS, generator=gen)[:n]
    dst_slots = torch.randperm(NUM_SLOTS, generator=gen)[:n]
    assert engine.store(tokens, kv_caches=source, slot_mapping=src_slots) == n
    assert engine.lookup(tokens) == n
    expected = [t.clone() for t in target]
    for i in range(n):
        for exp, src in zip(expected, source, strict=True):
            token_kv(exp, int(dst_slots[i])).copy_(token_kv(src, int(src_slots[i])))
    mask = engine.retrieve(tokens, kv_caches=target, slot_mapping=dst_slots)
    assert mask.dtype == torch.bool
    assert bool(mask.all())
    for got, want in zip(target, expected, strict=True):
        assert same_bits(got, want)


def new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.is_alive()]


def test_round_trip_and_close_stops_the_thread() -> None:
    before = set(threading.enumerate())
    engine = SyncCacheEngine.open(config(), LAYOUT, model_name="sync")
    assert new_threads(before), "the engine runs its event loop in its own thread"
    round_trip(engine, seed=1, n=3 * CHUNK + 5)
    assert engine.lookup([1, 2, 3]) == 0
    assert engine.lookup(list(range(CHUNK)), lookup_id="p", pin=True) == 0
    engine.lookup_unpin("p")
    stats = engine.stats()
    assert stats.cached_chunks == 4
    assert stats.pinned_chunks == 0
    assert engine.is_healthy()
    assert len(engine.take_events()) >= 1
    assert engine.clear() == 4
    assert engine.stats().pool.used_bytes == 0
    engine.close()
    assert not new_threads(before), "close() must stop the engine's threads"
    with pytest.raises(EngineClosedError):
        engine.lookup([1, 2, 3])
    engine.close()  # closing twice is harmless


def test_context_manager_and_errors_cross_the_thread() -> None:
    before = set(threading.enumerate())
    with SyncCacheEngine.open(config(), LAYOUT, model_name="sync") as engine:
        with pytest.raises(InvalidInputError):
            engine.store(
                list(range(CHUNK)), kv_caches=caches(0), slot_mapping=torch.arange(CHUNK - 1)
            )
        round_trip(engine, seed=2, n=2 * CHUNK)
        engine.freeze(True)
        assert engine.stats().frozen
        engine.freeze(False)
        engine.set_hot_cache(False)
        assert not engine.stats().hot_cache
        engine.set_hot_cache(True)
    assert not new_threads(before)


def test_two_threads_share_one_engine() -> None:
    errors: list[BaseException] = []
    before = set(threading.enumerate())

    with SyncCacheEngine.open(config(), LAYOUT, model_name="sync") as engine:

        def worker(base: int) -> None:
            try:
                for k in range(6):
                    round_trip(engine, seed=base + 10 * k, n=CHUNK * (1 + k % 3) + k)
            except BaseException as exc:  # reported to the main thread below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(b,)) for b in (3, 5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a worker thread hung"
        assert not errors, errors
        stats = engine.stats()
        assert stats.store_requests == 12
        assert stats.retrieve_requests == 12
    assert not new_threads(before)
