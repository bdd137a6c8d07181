"""The engine under faults and pressure: what a caller is told always matches the cache, and
nothing of a finished, failed, timed-out or cancelled request touches the caller's memory
after the call has returned."""

from __future__ import annotations

import math
import pickle
import threading
import time
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch

from lmcache_async import CacheEngine, ChunkKey, ConfigError, EngineConfig, KVLayout
from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.chunks import DIGEST_SIZE
from lmcache_async.memory.pool import page_size_for
from lmcache_async.transfer.plan import TransferPlan

pytestmark = pytest.mark.anyio

CHUNK = 16
BLOCKS = 64
LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=2, block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32
)
PAGE = page_size_for(math.prod(LAYOUT.payload_shape(CHUNK)) * 4)  # a chunk takes one


def config(**overrides: Any) -> EngineConfig:
    values: dict[str, Any] = {
        "chunk_size": CHUNK,
        "max_local_cpu_size": 0.01,
        "allocation_timeout": 0.3,
        "store_timeout": 20.0,
        "retrieve_timeout": 20.0,
    }
    values.update(overrides)
    return EngineConfig(**values)


def pages_gb(pages: int) -> float:
    return pages * PAGE / 1024**3


def caches(seed: int) -> list[torch.Tensor]:
    return LAYOUT.allocate_kv_caches(BLOCKS, generator=torch.Generator().manual_seed(seed))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def slots(n: int, offset: int = 0) -> torch.Tensor:
    return torch.arange(offset, offset + n, dtype=torch.int64)


async def test_a_store_larger_than_the_cache_reports_what_lookup_finds() -> None:
    """The store's own allocations must not evict the prefix it counts as cached."""
    with anyio.fail_after(20):
        for batch in (1, 8):
            cfg = config(max_local_cpu_size=pages_gb(2), pipeline_batch_chunks=batch)
            async with CacheEngine.open(cfg, LAYOUT, model_name="m") as engine:
                kv = caches(1)
                prompt = tokens(4 * CHUNK, seed=2)
                stored = await engine.store(prompt, kv_caches=kv, slot_mapping=slots(4 * CHUNK))
                assert 0 < stored < 4 * CHUNK  # a partial store...
                assert await engine.lookup(prompt) == stored  # ...that is a real prefix
                # Chunk 0 cached by an earlier store, chunk 1 new: both must stay reachable.
                await engine.clear()
                head = prompt[: 2 * CHUNK]
                assert await engine.store(head[:CHUNK], kv_caches=kv, slot_mapping=slots(CHUNK))
                other = tokens(CHUNK, seed=3)
                await engine.store(other, kv_caches=kv, slot_mapping=slots(CHUNK, 200))
                stored = await engine.store(head, kv_caches=kv, slot_mapping=slots(2 * CHUNK))
                assert stored == await engine.lookup(head) == 2 * CHUNK
                assert engine.stats().pool.num_objects == 2


async def test_a_failed_copy_leaves_nothing_running_after_the_store_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = TransferPlan.gather_chunks
    calls = {"n": 0}

    def first_copy_fails(self: TransferPlan, jobs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected copy failure")
        original(self, jobs)

    monkeypatch.setattr(TransferPlan, "gather_chunks", first_copy_fails)
    cfg = config(pipeline_batch_chunks=1, inline_copy_bytes=0)
    with anyio.fail_after(20):
        async with CacheEngine.open(cfg, LAYOUT, model_name="m") as engine:
            kv = caches(1)
            prompt = tokens(4 * CHUNK, seed=4)
            assert await engine.store(prompt, kv_caches=kv, slot_mapping=slots(4 * CHUNK)) == 0
            assert engine.stats().failed_requests == 1
            for layer in kv:  # the serving engine reuses its blocks at once
                layer.zero_()
            # Another store goes through the same stages: anything left of the failed one
            # would have been put by the time it finishes.
            other = tokens(CHUNK, seed=5)
            await engine.store(other, kv_caches=kv, slot_mapping=slots(CHUNK, 512))
            assert engine.stats().cached_chunks == 1
            assert await engine.lookup(prompt) == 0


async def test_a_cancelled_retrieve_returns_only_after_its_copy_finished(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = TransferPlan.scatter_chunks
    entered = threading.Event()
    release = threading.Event()
    started: list[bool] = []
    finished: list[bool] = []

    def held_scatter(self: TransferPlan, jobs: Any) -> None:
        started.append(True)
        entered.set()
        release.wait(10)
        original(self, jobs)
        finished.append(True)

    with anyio.fail_after(20):
        async with CacheEngine.open(config(inline_copy_bytes=0), LAYOUT, model_name="m") as engine:
            prompt = tokens(4 * CHUNK, seed=6)
            await engine.store(prompt, kv_caches=caches(1), slot_mapping=slots(4 * CHUNK))
            monkeypatch.setattr(TransferPlan, "scatter_chunks", held_scatter)
            target = caches(2)
            seen_at_return: list[list[bool]] = []

            async def retrieve_then_cancelled(scope: anyio.CancelScope) -> None:
                with scope:
                    await engine.retrieve(
                        prompt, kv_caches=target, slot_mapping=slots(4 * CHUNK, 512)
                    )
                seen_at_return.append(list(finished))

            scope = anyio.CancelScope()
            async with anyio.create_task_group() as tg:
                tg.start_soon(retrieve_then_cancelled, scope)
                await anyio.to_thread.run_sync(entered.wait, 10)
                scope.cancel()
                await anyio.wait_all_tasks_blocked()
                assert seen_at_return == []  # still waiting for the copy under way
                release.set()
            # every copy that had started was complete when the call came back
            assert seen_at_return == [[True] * len(started)]


async def test_a_timeout_before_the_request_entered_the_pipeline_costs_no_grace() -> None:
    cfg = config(
        max_local_cpu_size=pages_gb(1),
        store_timeout=0.3,
        allocation_timeout=30.0,
        pipeline_queue_size=1,
        pipeline_batch_chunks=1,
    )
    with anyio.fail_after(20):
        async with CacheEngine.open(cfg, LAYOUT, model_name="m") as engine:
            kv = caches(1)
            first = tokens(CHUNK, seed=7)
            await engine.store(first, kv_caches=kv, slot_mapping=slots(CHUNK))
            await engine.lookup(first, lookup_id="hold", pin=True)  # the only page, pinned
            took: list[float] = []

            async def one(i: int) -> None:
                start = time.monotonic()
                assert (
                    await engine.store(
                        tokens(CHUNK, seed=10 + i), kv_caches=kv, slot_mapping=slots(CHUNK, 16 * i)
                    )
                    == 0
                )
                took.append(time.monotonic() - start)

            async with anyio.create_task_group() as tg:
                for i in range(1, 7):
                    tg.start_soon(one, i)
            await engine.lookup_unpin("hold")
    # Each waited its own timeout (0.3 s), none the 10 s grace kept for copies under way.
    assert len(took) == 6 and max(took) < 5


async def test_malformed_key_input_is_an_invalid_input_error() -> None:
    with anyio.fail_after(20):
        async with CacheEngine.open(config(), LAYOUT, model_name="m") as engine:
            kv = caches(1)
            bad: list[dict[str, Any]] = [
                {"hashes": [1], "offsets": 16},
                {"hashes": 7, "offsets": [16]},
                {"hashes": [1], "offsets": ["x"]},
                {"tokens": 5},
                {"tokens": iter(range(16))},
                {"tokens": "abcdefghijklmnop"},
            ]
            for case in bad:
                with pytest.raises(InvalidInputError):
                    await engine.lookup(**case)
                with pytest.raises(InvalidInputError):
                    await engine.store(**case, kv_caches=kv, slot_mapping=slots(16))
            assert engine.stats().cached_chunks == 0


async def test_a_retrieve_with_bad_input_still_releases_its_pins() -> None:
    with anyio.fail_after(20):
        async with CacheEngine.open(config(), LAYOUT, model_name="m") as engine:
            kv = caches(1)
            prompt = tokens(2 * CHUNK, seed=8)
            await engine.store(prompt, kv_caches=kv, slot_mapping=slots(2 * CHUNK))
            assert await engine.lookup(prompt, lookup_id="r", pin=True) == 2 * CHUNK
            with pytest.raises(InvalidInputError):
                await engine.retrieve(
                    prompt, kv_caches=kv, slot_mapping=slots(2 * CHUNK + 1), lookup_id="r"
                )
            assert engine.stats().pinned_chunks == 0


def test_a_cache_smaller_than_one_chunk_is_refused_at_open() -> None:
    with pytest.raises(ConfigError) as info:
        CacheEngine.open(
            config(chunk_size=4096, max_local_cpu_size=pages_gb(1)), LAYOUT, model_name="m"
        )
    assert info.value.field == "max_local_cpu_size"


def test_chunk_keys_survive_copy_and_pickle() -> None:
    import copy

    for key in (ChunkKey(b"a" * DIGEST_SIZE), ChunkKey(b"a" * DIGEST_SIZE, 3)):
        assert copy.deepcopy(key) == key
        restored = pickle.loads(pickle.dumps(key))
        assert restored == key and restored.layer == key.layer
