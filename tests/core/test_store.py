"""The request core's store phases: what is skipped, the partial-store rule, commit and
abort, and that every byte of memory a store took comes back."""

from __future__ import annotations

import math

import anyio
import anyio.lowlevel
import pytest
import torch

from lmcache_async.backends.cpu import CPUBackend
from lmcache_async.backends.manager import StorageManager
from lmcache_async.core import StoreCore
from lmcache_async.events import EventBuffer
from lmcache_async.keys.chunks import ChunkHasher, ChunkSpan, Namespace
from lmcache_async.layouts import KVLayout
from lmcache_async.memory.pool import MemoryPool
from lmcache_async.stats import Counters

pytestmark = pytest.mark.anyio

CHUNK = 16
TIMEOUT = 10


class Scene:
    """A core over a real CPU tier and a pool of ``chunks`` chunk payloads."""

    def __init__(self, chunks: int, *, allocation_timeout: float = 0.05) -> None:
        self.layout = KVLayout.vllm_flash_attn(
            num_layers=2, block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16
        )
        chunk_bytes = math.prod(self.layout.payload_shape(CHUNK)) * 2
        self.pool = MemoryPool(chunks * max(chunk_bytes, 65536), page_size=65536)
        self.cpu = CPUBackend(self.pool)
        self.manager = StorageManager(
            self.cpu, events=EventBuffer(16, enabled=False), chunk_size=CHUNK, pin_timeout=60
        )
        self.counters = Counters()
        self.core = StoreCore(
            self.manager,
            self.pool,
            self.layout,
            self.counters,
            allocation_timeout=allocation_timeout,
            healthy=lambda: True,
        )
        hasher = ChunkHasher(Namespace(model_name="m", layout_fingerprint="f"), chunk_size=CHUNK)
        self.spans: list[ChunkSpan] = hasher.spans(list(range(5 * CHUNK)))

    def live_objects(self) -> int:
        return self.pool.stats().num_objects


async def test_a_store_skips_what_is_held_and_commits_the_rest() -> None:
    scene = Scene(8)
    core, spans = scene.core, scene.spans
    with anyio.fail_after(TIMEOUT):
        first = core.begin("a", spans[:2], None, limit=10**9, locations=None)
        objs = await core.reserve(first, first.todo)
        assert await core.commit(first, first.todo, objs) == 2
        assert core.finish(first) == 2 * CHUNK

        second = core.begin("b", spans[:4], None, limit=10**9, locations=None)
        assert second.todo == [2, 3]  # the first two are held already
        assert second.stored == [True, True, False, False]
        objs = await core.reserve(second, second.todo)
        await core.commit(second, second.todo, objs)
        assert core.finish(second) == 4 * CHUNK
    assert scene.counters.stored_tokens == 6 * CHUNK
    assert scene.manager.contains_prefix([span.key for span in spans]) == 4
    assert scene.live_objects() == 4  # the CPU tier's entries, nothing held by a store


async def test_no_chunk_past_the_limit_is_stored() -> None:
    scene = Scene(8)
    txn = scene.core.begin("a", scene.spans, None, limit=3 * CHUNK - 1, locations=None)
    assert [span.end for span in txn.spans] == [CHUNK, 2 * CHUNK]


async def test_memory_that_runs_out_makes_a_partial_store_of_the_prefix() -> None:
    scene = Scene(3)
    core = scene.core
    with anyio.fail_after(TIMEOUT):
        txn = core.begin("a", scene.spans, None, limit=10**9, locations=None)
        objs = await core.reserve(txn, txn.todo)
        assert len(objs) == 3 and txn.partial
        await core.commit(txn, txn.todo[: len(objs)], objs)
        assert core.finish(txn) == 3 * CHUNK
    assert scene.counters.partial_stores == 1


async def test_abort_returns_every_byte_and_counts_nothing() -> None:
    scene = Scene(8)
    core = scene.core
    with anyio.fail_after(TIMEOUT):
        held = core.begin("a", scene.spans[:1], None, limit=10**9, locations=None)
        await core.commit(held, held.todo, await core.reserve(held, held.todo))
        core.finish(held)
        before = scene.live_objects()
        txn = core.begin("b", scene.spans, None, limit=10**9, locations=None)
        objs = await core.reserve(txn, txn.todo)
        assert scene.live_objects() == before + 4
        assert core.abort(txn, objs) == 0
        assert core.finish(txn) == CHUNK  # already ended: counted once, at the abort (0)
    assert scene.live_objects() == before
    assert scene.counters.stored_tokens == CHUNK


async def test_finish_counts_a_store_once() -> None:
    scene = Scene(8)
    core = scene.core
    txn = core.begin("a", scene.spans[:2], None, limit=10**9, locations=None)
    await core.commit(txn, txn.todo, await core.reserve(txn, txn.todo))
    assert core.finish(txn) == core.finish(txn) == 2 * CHUNK
    assert scene.counters.stored_tokens == 2 * CHUNK


async def test_a_cancelled_owner_ends_the_wait_and_keeps_nothing() -> None:
    scene = Scene(2, allocation_timeout=TIMEOUT)
    core = scene.core

    class Owner:
        cancelled = False
        waiting: anyio.CancelScope | None = None

    owner = Owner()
    with anyio.fail_after(TIMEOUT):
        txn = core.begin("a", scene.spans, None, limit=10**9, locations=None)
        result: list[int] = []

        async def reserve() -> None:
            objs = await core.reserve(txn, txn.todo, owner)
            result.append(len(objs))
            core.abort(txn, objs)

        async with anyio.create_task_group() as tg:
            tg.start_soon(reserve)
            while owner.waiting is None:  # the third chunk waits for memory
                await anyio.lowlevel.checkpoint()
            owner.cancelled = True
            owner.waiting.cancel()
    assert result == [2] and not txn.partial
    assert scene.live_objects() == 0


async def test_open_counts_the_request_and_refuses_writes_when_frozen() -> None:
    scene = Scene(2)
    assert scene.core.open()
    scene.manager.freeze(True)
    assert not scene.core.open()
    assert scene.counters.store_requests == 2


async def test_a_layerwise_store_keeps_each_chunk_whole_in_every_layer() -> None:
    scene = Scene(16)
    core, spans = scene.core, scene.spans[:3]
    layers = scene.layout.num_layers
    with anyio.fail_after(TIMEOUT):
        txn = core.begin("a", spans, None, limit=10**9, locations=None, layers=layers)
        objs = await core.reserve(txn, txn.todo)
        assert len(objs) == 3 * layers
        assert await core.commit(txn, txn.todo, objs) == 3
        assert core.finish(txn) == 3 * CHUNK
        keys = [span.key.with_layer(layer) for span in spans for layer in range(layers)]
        assert scene.manager.contains_prefix(keys) == 3 * layers
        # A chunk missing one layer is not held: it is written again, every layer.
        await scene.manager.remove([spans[1].key.with_layer(1)])
        again = core.begin("b", spans, None, limit=10**9, locations=None, layers=layers)
        assert again.stored == [True, False, True]
        assert again.todo == [1]
        core.abort(again)
    assert scene.live_objects() == 3 * layers - 1  # the tier's entries only


async def test_a_layerwise_chunk_that_gets_part_of_its_memory_is_not_reserved() -> None:
    scene = Scene(3)  # room for three payloads: one chunk of two layers, half of the next
    core = scene.core
    layers = scene.layout.num_layers
    with anyio.fail_after(TIMEOUT):
        txn = core.begin("a", scene.spans, None, limit=10**9, locations=None, layers=layers)
        objs = await core.reserve(txn, txn.todo)
        assert len(objs) == layers and txn.partial
        core.abort(txn, objs)
    assert scene.live_objects() == 0
