"""Layerwise store and retrieve through the engine: the step protocol, bit-exact round trips
for every layout and dtype, real layer-by-layer progress, lookups that need every layer,
mixing with whole-chunk operations, partial stores, failures and cancellation.

Every data check is bit for bit: targets start filled with a random sentinel, and after a
retrieve each layer must equal that sentinel with exactly the loaded tokens' KV written.
"""

from __future__ import annotations

import contextlib
import gc
import math
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from lmcache_async import CacheEngine, EngineConfig, InvalidInputError, KVLayout
from lmcache_async.errors import EngineClosedError
from lmcache_async.memory.pool import page_size_for
from lmcache_async.transfer.cuda import Direction
from lmcache_async.transfer.layer_copies import LayerCopies
from lmcache_async.transfer.plan import TransferPlan

NUM_LAYERS = 3
NUM_HEADS = 2
HEAD_SIZE = 8
LATENT_DIM = 16
BLOCK_SIZE = 16
NUM_BLOCKS = 24
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE
CHUNK = 16
TIMEOUT = 20

KINDS = ("flash_nhd", "flash_hnd", "flashinfer", "mla", "vllm_cpu")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT_OF = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


# ---------------------------------------------------------------------------- helpers


def make_layout(kind: str, dtype: torch.dtype) -> KVLayout:
    if kind in ("flash_nhd", "flash_hnd"):
        return KVLayout.vllm_flash_attn(
            num_layers=NUM_LAYERS,
            block_size=BLOCK_SIZE,
            num_kv_heads=NUM_HEADS,
            head_size=HEAD_SIZE,
            dtype=dtype,
            hnd=kind == "flash_hnd",
        )
    if kind == "flashinfer":
        return KVLayout.flashinfer(
            num_layers=NUM_LAYERS,
            block_size=BLOCK_SIZE,
            num_kv_heads=NUM_HEADS,
            head_size=HEAD_SIZE,
            dtype=dtype,
        )
    if kind == "mla":
        return KVLayout.mla(
            num_layers=NUM_LAYERS, block_size=BLOCK_SIZE, latent_dim=LATENT_DIM, dtype=dtype
        )
    return KVLayout.vllm_cpu(
        num_layers=NUM_LAYERS,
        num_kv_heads=NUM_HEADS,
        head_size=HEAD_SIZE,
        dtype=dtype,
        block_size=BLOCK_SIZE,
    )


def token_views(kind: str, layer: torch.Tensor, slot: int) -> list[torch.Tensor]:
    """Everything one token owns in one layer tensor (views, written through)."""
    block, offset = divmod(slot, BLOCK_SIZE)
    if kind in ("flash_nhd", "flash_hnd"):
        return [layer[:, block, offset]]
    if kind == "flashinfer":
        return [layer[block, :, offset]]
    if kind == "mla":
        return [layer[block, offset]]
    # vLLM CPU: per block and head, keys [head_size, block_size] (a token is a column),
    # then values [block_size, head_size] (a token is a row).
    nb = layer.shape[0]
    keys = layer.view(nb, NUM_HEADS, 2, HEAD_SIZE, BLOCK_SIZE)[block, :, 0, :, offset]
    values = layer.view(nb, NUM_HEADS, 2, BLOCK_SIZE, HEAD_SIZE)[block, :, 1, offset]
    return [keys, values]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_OF[t.dtype])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(bits(a), bits(b))


def caches(layout: KVLayout, seed: int) -> list[torch.Tensor]:
    return layout.allocate_kv_caches(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))


def slots_for(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(NUM_SLOTS, generator=torch.Generator().manual_seed(seed))[:n]


def tokens_for(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, 50_000, (n,), generator=gen)]


def expected_layer(
    kind: str,
    *,
    before: torch.Tensor,
    source: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    loaded: torch.Tensor,
) -> torch.Tensor:
    out = before.clone()
    for i in torch.nonzero(loaded).view(-1).tolist():
        if int(dst_slots[i]) >= 0:
            views = zip(
                token_views(kind, out, int(dst_slots[i])),
                token_views(kind, source, int(src_slots[i])),
                strict=True,
            )
            for out_view, src_view in views:
                out_view.copy_(src_view)
    return out


class Scene:
    """One prompt's KV in a source cache and a sentinel-filled target cache."""

    def __init__(self, kind: str, dtype: torch.dtype, n: int, seed: int) -> None:
        self.kind = kind
        self.layout = make_layout(kind, dtype)
        self.source = caches(self.layout, seed)
        self.target = caches(self.layout, seed + 1)
        self.tokens = tokens_for(n, seed + 2)
        self.src_slots = slots_for(n, seed + 3)
        self.dst_slots = slots_for(n, seed + 4)

    def store(self, engine: CacheEngine, **kwargs: Any) -> Any:
        return engine.store_layer(
            self.tokens, kv_caches=self.source, slot_mapping=self.src_slots, **kwargs
        )

    def retrieve(self, engine: CacheEngine, **kwargs: Any) -> Any:
        return engine.retrieve_layer(
            self.tokens, kv_caches=self.target, slot_mapping=self.dst_slots, **kwargs
        )

    async def store_whole(self, engine: CacheEngine) -> int:
        return await engine.store(self.tokens, kv_caches=self.source, slot_mapping=self.src_slots)

    async def retrieve_whole(self, engine: CacheEngine) -> torch.Tensor:
        return await engine.retrieve(
            self.tokens, kv_caches=self.target, slot_mapping=self.dst_slots
        )

    def expected(self, before: Sequence[torch.Tensor], loaded: torch.Tensor) -> list[torch.Tensor]:
        return [
            expected_layer(
                self.kind,
                before=b,
                source=s,
                src_slots=self.src_slots,
                dst_slots=self.dst_slots,
                loaded=loaded,
            )
            for b, s in zip(before, self.source, strict=True)
        ]

    def assert_target(self, before: Sequence[torch.Tensor], loaded: torch.Tensor) -> None:
        for layer, (actual, want) in enumerate(
            zip(self.target, self.expected(before, loaded), strict=True)
        ):
            assert same(actual, want), f"layer {layer} differs"


async def run_all(iterator: Any) -> list[Any]:
    """Drive an iterator to its end; returns what every step yielded."""
    return [item async for item in iterator]


def prefix(n: int, start: int, stop: int) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[start:stop] = True
    return mask


@asynccontextmanager
async def open_engine(layout: KVLayout, **overrides: Any) -> AsyncIterator[CacheEngine]:
    values: dict[str, Any] = {"chunk_size": CHUNK, "max_local_cpu_size": 0.01}
    values.update(overrides)
    async with CacheEngine.open(EngineConfig(**values), layout, model_name="m") as engine:
        yield engine


async def wait_for(predicate: Callable[[], bool]) -> None:
    """Wait, bounded, until ``predicate()`` holds (checked every millisecond)."""
    with anyio.fail_after(TIMEOUT):
        while True:
            if predicate():
                return
            await anyio.sleep(0.001)


def page_of(layout: KVLayout) -> int:
    """The engine's pool page for ``layout``: a whole chunk's payload takes one (without
    ``use_layerwise``), and so does each per-layer payload."""
    return page_size_for(math.prod(layout.payload_shape(CHUNK)) * layout.dtype.itemsize)


def pool_use(engine: CacheEngine) -> tuple[int, int]:
    pool = engine.stats().pool
    return pool.used_bytes, pool.num_objects


async def layer_hits(engine: CacheEngine, tokens: Sequence[int]) -> int:
    """Chunks whose every layer is cached (the lookup the engine uses in layerwise mode)."""
    return await engine._parts.layerwise.lookup(engine.key_hasher.digests(tokens))


# ---------------------------------------------------------------------------- round trips


@pytest.mark.anyio
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", KINDS)
async def test_round_trip_is_bit_exact(kind: str, dtype: torch.dtype) -> None:
    n = 2 * CHUNK + 5  # two full chunks and a short one
    scene = Scene(kind, dtype, n, seed=KINDS.index(kind) * 10 + DTYPES.index(dtype))
    with anyio.fail_after(TIMEOUT):
        async with open_engine(scene.layout) as engine:
            steps = await run_all(scene.store(engine))
            assert steps == [None] * NUM_LAYERS + [n]
            assert await layer_hits(engine, scene.tokens) == 3
            before = [t.clone() for t in scene.target]
            steps = await run_all(scene.retrieve(engine))
            assert steps[:-1] == [None] * NUM_LAYERS
            mask = steps[-1]
            assert mask.dtype == torch.bool and mask.device.type == "cpu"
            assert mask.tolist() == [True] * n
            scene.assert_target(before, mask)
            stats = engine.stats()
            assert (stats.stored_tokens, stats.retrieved_tokens) == (n, n)
            assert (stats.store_requests, stats.retrieve_requests) == (1, 1)
            assert stats.cached_chunks == 3 * NUM_LAYERS  # one entry per chunk per layer


@pytest.mark.anyio
async def test_exactly_one_step_per_layer_plus_one() -> None:
    scene = Scene("flash_nhd", torch.float16, CHUNK, seed=1)
    async with open_engine(scene.layout) as engine:
        it = scene.store(engine)
        for _ in range(NUM_LAYERS):
            assert await anext(it) is None
        assert await anext(it) == CHUNK
        with pytest.raises(StopAsyncIteration):
            await anext(it)
        it = scene.retrieve(engine)
        for _ in range(NUM_LAYERS):
            assert await anext(it) is None
        assert (await anext(it)).all()
        with pytest.raises(StopAsyncIteration):
            await anext(it)


@pytest.mark.anyio
async def test_miss_still_takes_every_step_and_writes_nothing() -> None:
    scene = Scene("flashinfer", torch.float32, 40, seed=2)
    async with open_engine(scene.layout) as engine:
        before = [t.clone() for t in scene.target]
        steps = await run_all(scene.retrieve(engine))
        assert steps[:-1] == [None] * NUM_LAYERS
        assert not steps[-1].any()
        scene.assert_target(before, steps[-1])


# ---------------------------------------------------------------------------- progress


@pytest.mark.anyio
async def test_retrieve_yields_layer_i_before_layer_i_plus_1_is_copied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scene = Scene("flash_hnd", torch.float16, 2 * CHUNK, seed=3)
    copied: list[int] = []
    original = TransferPlan.scatter_layer_chunks

    def recording(self: TransferPlan, layer: int, jobs: Any) -> None:
        original(self, layer, jobs)
        copied.append(layer)

    async with open_engine(scene.layout) as engine:
        assert await anext_last(scene.store(engine)) == 2 * CHUNK
        monkeypatch.setattr(TransferPlan, "scatter_layer_chunks", recording)
        before = [t.clone() for t in scene.target]
        loaded = prefix(2 * CHUNK, 0, 2 * CHUNK)
        want = scene.expected(before, loaded)
        it = scene.retrieve(engine)
        assert await anext(it) is None  # the lookup: nothing copied yet
        assert copied == []
        assert all(same(t, b) for t, b in zip(scene.target, before, strict=True))
        for layer in range(NUM_LAYERS):
            await anext(it)
            assert copied == list(range(layer + 1))
            for other in range(NUM_LAYERS):
                expected = want[other] if other <= layer else before[other]
                assert same(scene.target[other], expected), (layer, other)


@pytest.mark.anyio
async def test_store_copies_each_layer_after_its_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine computes layer i, then steps: what is stored is each layer's final KV."""
    scene = Scene("vllm_cpu", torch.bfloat16, 2 * CHUNK + 3, seed=4)
    computed = [t.clone() for t in scene.source]
    for tensor in scene.source:
        tensor.zero_()  # nothing computed yet
    gathered: list[int] = []
    original = TransferPlan.gather_layer_chunks

    def recording(self: TransferPlan, layer: int, jobs: Any) -> None:
        original(self, layer, jobs)
        gathered.append(layer)

    monkeypatch.setattr(TransferPlan, "gather_layer_chunks", recording)
    async with open_engine(scene.layout) as engine:
        it = scene.store(engine)
        for layer in range(NUM_LAYERS):
            scene.source[layer].copy_(computed[layer])  # "compute" layer i
            assert await anext(it) is None
            assert gathered == list(range(layer + 1))
        assert await anext(it) == len(scene.tokens)
        before = [t.clone() for t in scene.target]
        mask = await anext_last(scene.retrieve(engine))
        assert mask.all()
        scene.source = computed
        scene.assert_target(before, mask)


@pytest.mark.anyio
async def test_small_layers_are_copied_on_the_event_loop_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scene = Scene("mla", torch.float16, 2 * CHUNK, seed=5)
    threads: set[int] = set()
    gather, scatter = TransferPlan.gather_layer_chunks, TransferPlan.scatter_layer_chunks

    def on_gather(self: TransferPlan, layer: int, jobs: Any) -> None:
        threads.add(threading.get_ident())
        gather(self, layer, jobs)

    def on_scatter(self: TransferPlan, layer: int, jobs: Any) -> None:
        threads.add(threading.get_ident())
        scatter(self, layer, jobs)

    monkeypatch.setattr(TransferPlan, "gather_layer_chunks", on_gather)
    monkeypatch.setattr(TransferPlan, "scatter_layer_chunks", on_scatter)
    async with open_engine(scene.layout) as engine:
        assert await anext_last(scene.store(engine)) == 2 * CHUNK
        assert (await anext_last(scene.retrieve(engine))).all()
    assert threads == {threading.get_ident()}


@pytest.mark.anyio
async def test_large_layers_are_copied_in_threads_and_stay_exact() -> None:
    scene = Scene("flash_nhd", torch.float32, 3 * CHUNK, seed=6)
    async with open_engine(scene.layout, inline_copy_bytes=0) as engine:
        assert await anext_last(scene.store(engine)) == 3 * CHUNK
        before = [t.clone() for t in scene.target]
        mask = await anext_last(scene.retrieve(engine))
        assert mask.all()
        scene.assert_target(before, mask)


async def anext_last(iterator: Any) -> Any:
    return (await run_all(iterator))[-1]


# The CUDA schedule (the next layer queued while the step returns, the caller's stream
# ordered on the device) runs over CPU memory with stand-in streams in
# tests/transfer/test_layerwise_cuda.py.


# ---------------------------------------------------------------------------- lookups, mixing


@pytest.mark.anyio
async def test_a_chunk_counts_only_when_every_layer_is_cached() -> None:
    scene = Scene("flash_nhd", torch.float16, 3 * CHUNK, seed=7)
    async with open_engine(scene.layout) as engine:
        assert await anext_last(scene.store(engine)) == 3 * CHUNK
        assert await layer_hits(engine, scene.tokens) == 3
        spans = engine.key_hasher.spans(scene.tokens)
        await engine._parts.manager.remove([spans[1].key.with_layer(NUM_LAYERS - 1)])
        assert await layer_hits(engine, scene.tokens) == 1
        before = [t.clone() for t in scene.target]
        mask = await anext_last(scene.retrieve(engine))
        assert mask.tolist() == prefix(3 * CHUNK, 0, CHUNK).tolist()
        scene.assert_target(before, mask)
        # Storing again restores the missing layer (the others stay as they are).
        assert await anext_last(scene.store(engine)) == 3 * CHUNK
        assert await layer_hits(engine, scene.tokens) == 3
        assert engine.stats().pool.num_objects == 3 * NUM_LAYERS


@pytest.mark.anyio
async def test_layerwise_and_whole_chunk_entries_never_mix() -> None:
    """A prefix stored one way is a miss the other way: never wrong bytes."""
    whole = Scene("flashinfer", torch.float16, 2 * CHUNK, seed=8)
    layered = Scene("flashinfer", torch.float16, 2 * CHUNK, seed=9)
    async with open_engine(whole.layout) as engine:
        assert await whole.store_whole(engine) == 2 * CHUNK
        assert await anext_last(layered.store(engine)) == 2 * CHUNK
        # Whole-chunk lookup sees only the whole-chunk store; layerwise only its own.
        assert await engine.lookup(whole.tokens) == 2 * CHUNK
        assert await engine.lookup(layered.tokens) == 0
        assert await layer_hits(engine, whole.tokens) == 0
        assert await layer_hits(engine, layered.tokens) == 2
        before = [t.clone() for t in whole.target]
        mask = await anext_last(whole.retrieve(engine))
        assert not mask.any()
        whole.assert_target(before, mask)
        before = [t.clone() for t in layered.target]
        mask = await layered.retrieve_whole(engine)
        assert not mask.any()
        layered.assert_target(before, mask)
        # Each way round trips its own entries exactly.
        before = [t.clone() for t in layered.target]
        mask = await anext_last(layered.retrieve(engine))
        assert mask.all()
        layered.assert_target(before, mask)
        before = [t.clone() for t in whole.target]
        mask = await whole.retrieve_whole(engine)
        assert mask.all()
        whole.assert_target(before, mask)


@pytest.mark.anyio
async def test_pins_for_the_lookup_id_are_released_at_the_end() -> None:
    scene = Scene("mla", torch.float32, 2 * CHUNK, seed=10)
    async with open_engine(scene.layout) as engine:
        assert await anext_last(scene.store(engine)) == 2 * CHUNK
        assert engine._parts.layerwise.pin(engine.key_hasher.digests(scene.tokens), "req") == 2
        assert engine.stats().pinned_chunks == 2 * NUM_LAYERS
        mask = await anext_last(scene.retrieve(engine, lookup_id="req"))
        assert mask.all()
        assert engine.stats().pinned_chunks == 0
        assert engine.stats().active_lookup_ids == 0


@pytest.mark.anyio
async def test_a_receiver_removes_every_layer_of_what_it_loaded() -> None:
    """remove_after_retrieve (disaggregated prefill's receiver): loaded chunks leave the
    cache with all their layers; a chunk that was not loaded stays."""
    scene = Scene("flash_nhd", torch.float16, 3 * CHUNK, seed=12)
    async with open_engine(scene.layout, remove_after_retrieve=True) as engine:
        assert await anext_last(scene.store(engine)) == 3 * CHUNK
        spans = engine.key_hasher.spans(scene.tokens)
        await engine._parts.manager.remove([spans[1].key.with_layer(0)])  # chunk 1 is incomplete
        before = [t.clone() for t in scene.target]
        mask = await anext_last(scene.retrieve(engine))
        assert mask.tolist() == prefix(3 * CHUNK, 0, CHUNK).tolist()
        scene.assert_target(before, mask)
        assert await layer_hits(engine, scene.tokens) == 0
        # Chunk 0 is gone in every layer; chunk 1's remaining layers and chunk 2 stay.
        assert engine.stats().cached_chunks == (NUM_LAYERS - 1) + NUM_LAYERS
        assert engine.stats().pool.num_objects == (NUM_LAYERS - 1) + NUM_LAYERS
        mask = await anext_last(scene.retrieve(engine))
        assert not mask.any()


@pytest.mark.anyio
async def test_a_second_store_copies_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    scene = Scene("flash_hnd", torch.float32, 2 * CHUNK, seed=11)
    async with open_engine(scene.layout) as engine:
        assert await anext_last(scene.store(engine)) == 2 * CHUNK
        used = pool_use(engine)

        def no_copy(self: TransferPlan, layer: int, jobs: Any) -> None:
            raise AssertionError("copied a chunk already cached")

        monkeypatch.setattr(TransferPlan, "gather_layer_chunks", no_copy)
        assert await anext_last(scene.store(engine)) == 2 * CHUNK
        assert pool_use(engine) == used


# ---------------------------------------------------------------------------- masks, slots


@pytest.mark.anyio
async def test_mask_and_negative_slots() -> None:
    n = 3 * CHUNK
    scene = Scene("flash_nhd", torch.bfloat16, n, seed=12)
    async with open_engine(scene.layout) as engine:
        # A negative source slot in chunk 2 stops the store before that chunk.
        scene.src_slots[2 * CHUNK + 3] = -1
        assert await anext_last(scene.store(engine)) == 2 * CHUNK
        # Retrieve from chunk 1 on, into a target with one skipped token.
        scene.dst_slots[CHUNK + 4] = -1
        before = [t.clone() for t in scene.target]
        mask = await anext_last(scene.retrieve(engine, mask=prefix(n, CHUNK, n)))
        want = prefix(n, CHUNK, 2 * CHUNK)
        want[CHUNK + 4] = False
        assert mask.tolist() == want.tolist()
        scene.assert_target(before, mask)


@pytest.mark.anyio
async def test_bad_input_is_refused_at_the_call() -> None:
    scene = Scene("flash_nhd", torch.float16, CHUNK, seed=13)
    async with open_engine(scene.layout) as engine:
        with pytest.raises(InvalidInputError):
            engine.store_layer(
                scene.tokens, kv_caches=scene.source[:1], slot_mapping=scene.src_slots
            )
        with pytest.raises(InvalidInputError):
            engine.retrieve_layer(
                scene.tokens, kv_caches=scene.target, slot_mapping=scene.dst_slots[:3]
            )
        assert pool_use(engine) == (0, 0)
    with pytest.raises(EngineClosedError):
        scene.store(engine)
    with pytest.raises(EngineClosedError):
        scene.retrieve(engine)


@pytest.mark.anyio
async def test_frozen_engine_stores_nothing_but_takes_every_step() -> None:
    scene = Scene("flash_nhd", torch.float16, CHUNK, seed=14)
    async with open_engine(scene.layout) as engine:
        engine.freeze(True)
        assert await run_all(scene.store(engine)) == [None] * NUM_LAYERS + [0]
        engine.freeze(False)
        assert await layer_hits(engine, scene.tokens) == 0
        assert pool_use(engine) == (0, 0)


# ---------------------------------------------------------------------------- memory


@pytest.mark.anyio
async def test_partial_store_when_memory_runs_out() -> None:
    """Eight pages; each per-layer payload takes one: two chunks fit, the third waits."""
    scene = Scene("flash_nhd", torch.float32, 4 * CHUNK, seed=15)
    size_gb = 8 * page_of(scene.layout) / 1024**3
    async with open_engine(scene.layout, max_local_cpu_size=size_gb, allocation_timeout=0.05) as e:
        assert await anext_last(scene.store(e)) == 2 * CHUNK
        assert e.stats().partial_stores == 1
        assert await layer_hits(e, scene.tokens) == 2
        before = [t.clone() for t in scene.target]
        mask = await anext_last(scene.retrieve(e))
        assert mask.tolist() == prefix(4 * CHUNK, 0, 2 * CHUNK).tolist()
        scene.assert_target(before, mask)


@pytest.mark.anyio
@pytest.mark.parametrize("steps", [0, 1, NUM_LAYERS])
async def test_closing_a_store_early_returns_its_memory(steps: int) -> None:
    scene = Scene("flashinfer", torch.float32, 3 * CHUNK, seed=16)
    async with open_engine(scene.layout) as engine:
        it = scene.store(engine)
        for _ in range(steps):
            await anext(it)
        if steps:
            assert pool_use(engine)[1] == 3 * NUM_LAYERS  # allocated at the first step
        await it.aclose()
        assert pool_use(engine) == (0, 0)
        assert await layer_hits(engine, scene.tokens) == 0


@pytest.mark.anyio
@pytest.mark.parametrize("steps", [1, 2, NUM_LAYERS])
async def test_closing_a_retrieve_early_returns_its_references(steps: int) -> None:
    scene = Scene("mla", torch.bfloat16, 3 * CHUNK, seed=17)
    async with open_engine(scene.layout) as engine:
        assert await anext_last(scene.store(engine)) == 3 * CHUNK
        used = pool_use(engine)
        it = scene.retrieve(engine)
        for _ in range(steps):
            await anext(it)
        await it.aclose()
        assert pool_use(engine) == used
        # Every entry is back to the cache's own reference: all of it can be evicted.
        assert await engine.clear() == 3 * NUM_LAYERS
        assert pool_use(engine) == (0, 0)


@pytest.mark.anyio
async def test_breaking_out_of_async_for_returns_memory() -> None:
    scene = Scene("flash_nhd", torch.float16, 2 * CHUNK, seed=18)
    async with open_engine(scene.layout) as engine:
        async with contextlib.aclosing(scene.store(engine)) as it:
            async for _ in it:
                break
        assert pool_use(engine) == (0, 0)
        # Without aclosing, the event loop's async generator hook closes it once dropped.
        it = scene.store(engine)
        async for _ in it:
            break
        assert pool_use(engine)[1] == 2 * NUM_LAYERS
        del it
        gc.collect()
        await wait_for(lambda: pool_use(engine) == (0, 0))


@pytest.mark.anyio
async def test_cancelling_a_store_waiting_for_memory_returns_it() -> None:
    layout = make_layout("flash_nhd", torch.float32)
    size_gb = 8 * page_of(layout) / 1024**3
    async with open_engine(layout, max_local_cpu_size=size_gb, allocation_timeout=30.0) as engine:
        filler = Scene("flash_nhd", torch.float32, 8 * CHUNK, seed=19)
        assert await filler.store_whole(engine) == 8 * CHUNK
        assert await engine.lookup(filler.tokens, lookup_id="hold", pin=True) == 8 * CHUNK
        used = pool_use(engine)
        scene = Scene("flash_nhd", torch.float32, CHUNK, seed=20)
        finished: list[object] = []

        async def store() -> None:
            finished.append(await anext(scene.store(engine)))

        with anyio.fail_after(TIMEOUT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(store)
                await wait_for(lambda: engine.stats().pool.waiters > 0)
                tg.cancel_scope.cancel()
        assert not finished
        assert engine.stats().pool.waiters == 0
        assert pool_use(engine) == used
        await engine.lookup_unpin("hold")


@pytest.mark.anyio
async def test_closing_the_engine_mid_way_ends_the_iterators_cleanly() -> None:
    scene = Scene("mla", torch.float16, 2 * CHUNK, seed=25)
    async with open_engine(scene.layout) as engine:
        assert await anext_last(scene.store(engine)) == 2 * CHUNK
        longer = Scene("mla", torch.float16, 3 * CHUNK, seed=25)
        store = longer.store(engine)
        retrieve = scene.retrieve(engine)
        await anext(store)
        await anext(retrieve)
        await anext(retrieve)
        pool = engine._parts.pool
    assert [item async for item in store] == [None] * (NUM_LAYERS - 1) + [0]
    rest = [item async for item in retrieve]
    assert rest[:-1] == [None] * (NUM_LAYERS - 2)
    assert not rest[-1].any()
    assert (pool.stats().num_objects, pool.stats().used_bytes) == (0, 0)


# ---------------------------------------------------------------------------- failures


@pytest.mark.anyio
async def test_a_failed_copy_loads_nothing_and_returns_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scene = Scene("flash_nhd", torch.float16, 2 * CHUNK, seed=21)
    original = TransferPlan.scatter_layer_chunks

    def fail_layer_1(self: TransferPlan, layer: int, jobs: Any) -> None:
        if layer == 1:
            raise RuntimeError("device lost")
        original(self, layer, jobs)

    async with open_engine(scene.layout) as engine:
        assert await anext_last(scene.store(engine)) == 2 * CHUNK
        used = pool_use(engine)
        monkeypatch.setattr(TransferPlan, "scatter_layer_chunks", fail_layer_1)
        steps = await run_all(scene.retrieve(engine))
        assert len(steps) == NUM_LAYERS + 1
        assert not steps[-1].any()
        assert engine.stats().failed_requests == 1
        assert pool_use(engine) == used


@pytest.mark.anyio
async def test_a_failed_gather_stores_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    scene = Scene("vllm_cpu", torch.float32, 2 * CHUNK, seed=22)

    def fail(self: TransferPlan, layer: int, jobs: Any) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(TransferPlan, "gather_layer_chunks", fail)
    async with open_engine(scene.layout) as engine:
        assert await run_all(scene.store(engine)) == [None] * NUM_LAYERS + [0]
        assert engine.stats().failed_requests == 1
        assert pool_use(engine) == (0, 0)
        assert await layer_hits(engine, scene.tokens) == 0


# ------------------------------------------------------------ the caller's stream


class Point:
    """Stands in for a CallerStream: each mark() is a new point, listed in ``marks``;
    handed_over() is the same point, ``of`` it, whose stream waits for no copy; consume()
    lists the events its stream was made to wait for."""

    def __init__(self, marks: list[Point], of: Point | None = None) -> None:
        self.marks = marks
        self.of = of
        self.consumed: list[Any] = []

    def mark(self) -> Point:
        point = Point(self.marks)
        self.marks.append(point)
        return point

    def handed_over(self) -> Point:
        return Point(self.marks, of=self)

    def consume(self, event: Any) -> None:
        self.consumed.append(event)


class Queued:
    """Stands in for a queued copy: its event, and a completion awaited on the loop."""

    def __init__(self, event: str) -> None:
        self.event = event

    async def wait(self) -> None:
        return None


class RecordingTransfers:
    """Stands in for Transfers: records the caller point each copy is ordered against."""

    def __init__(self) -> None:
        self.callers: list[Any] = []

    async def queue(self, work: Any, jobs: Any, *, caller: Any = None, **kwargs: Any) -> Queued:
        self.callers.append(caller)
        return Queued(f"layer{len(self.callers) - 1}")


@pytest.mark.anyio
@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
async def test_layer_copies_on_cuda_follow_the_callers_stream(direction: Direction) -> None:
    """A store step's copy follows a point marked at the step (after the caller queued
    that layer's compute); every layer of a load follows the request's own point, and
    the caller's stream is made to wait for it only when the layer is handed over (a
    wait queued with layer i + 1's copy would hold back the caller's layer i)."""
    marks: list[Point] = []
    point = Point(marks)
    transfers = RecordingTransfers()
    copies = LayerCopies(transfers, torch.device("cuda", 0), direction, 5, point)  # type: ignore[arg-type]
    with anyio.fail_after(TIMEOUT):
        for layer in range(NUM_LAYERS):
            await copies.start(layer, lambda jobs: None, [], 0)
            if direction is Direction.LOAD:  # not before its step hands it over
                assert point.consumed == [f"layer{i}" for i in range(layer)]
            copies.hand_over(layer)
        await copies.finish()
    if direction is Direction.STORE:
        assert len(marks) == NUM_LAYERS and transfers.callers == marks
        assert point.consumed == []
    else:
        assert marks == [] and [caller.of for caller in transfers.callers] == [point] * NUM_LAYERS
        assert point.consumed == [f"layer{i}" for i in range(NUM_LAYERS)]


# ---------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["flash_nhd", "mla"])
async def test_cuda_round_trip_layer_by_layer(kind: str) -> None:
    """Device caches, pinned host payloads: each step returns with its layer in place."""
    n = 3 * CHUNK + 1
    scene = Scene(kind, torch.float16, n, seed=23)
    source_cpu, before = scene.source, [t.clone() for t in scene.target]
    want = [
        expected_layer(
            kind,
            before=b,
            source=s,
            src_slots=scene.src_slots,
            dst_slots=scene.dst_slots,
            loaded=prefix(n, 0, n),
        )
        for b, s in zip(before, source_cpu, strict=True)
    ]
    scene.source = [t.cuda() for t in source_cpu]
    scene.target = [t.cuda() for t in before]
    async with open_engine(scene.layout) as engine:
        assert await anext_last(scene.store(engine)) == n
        it = scene.retrieve(engine)
        assert await anext(it) is None
        result = None
        for layer in range(NUM_LAYERS):
            result = await anext(it)
            assert same(scene.target[layer].cpu(), want[layer]), layer
        assert result is not None and result.all()
        assert engine.stats().pool.num_objects == (n // CHUNK + 1) * NUM_LAYERS
