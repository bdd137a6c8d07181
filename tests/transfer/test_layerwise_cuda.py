"""The layerwise pipeline's CUDA schedule, run over CPU memory with stand-in streams and
events (``tests/fake_cuda.py``, ``host_device``): a retrieve step orders the caller's
stream after its layer with ``wait_event`` and returns before the copy has completed (its
events are held), layer *i + 1* queued; a store step returns with its layer's copy still
queued; each layer is one kernel and one host copy, whatever the number of chunks; the
bytes are exact and closing early returns every page and reference."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch

from lmcache_async.transfer.cuda import Direction
from lmcache_async.transfer.layer_staged import StagedLayers
from tests.fake_cuda import CUDA, FakeCuda, install
from tests.pipelines.test_layerwise import (
    CHUNK,
    NUM_LAYERS,
    TIMEOUT,
    Scene,
    anext_last,
    open_engine,
    pool_use,
    prefix,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    fake = install(monkeypatch, host_device=True)
    yield fake
    fake.release()  # whatever a failed test held


def records_on(cuda: FakeCuda, stream: str) -> list[str]:
    """The events recorded on ``stream``, in order."""
    return [entry[1] for entry in cuda.log if entry[0] == "record" and entry[2] == stream]


async def step(it: Any) -> Any:
    with anyio.fail_after(TIMEOUT):
        return await anext(it)


@pytest.mark.parametrize("chunks", [2, 5])
async def test_a_retrieve_step_hands_its_layer_over_on_the_device_not_the_host(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, chunks: int
) -> None:
    """With every CUDA event held (nothing completes), step i + 1 still returns: it made
    the caller's stream wait for layer i's event and queued layer i + 1. The whole
    retrieve is one H2D copy and one scatter kernel per layer, for 2 chunks as for 5."""
    n = chunks * CHUNK
    scene = Scene("flash_nhd", torch.float16, n, seed=30)
    async with open_engine(scene.layout, use_layerwise=True) as engine:
        assert await anext_last(scene.store(engine)) == n
        before = [t.clone() for t in scene.target]
        cuda.log.clear()
        cuda.synced.clear()
        cuda.count_ops(monkeypatch)
        it = scene.retrieve(engine)
        with cuda.held():
            assert await step(it) is None  # the lookup, and layer 0 queued
            load = engine._parts.transfers.lanes(CUDA, Direction.LOAD).home.name
            assert len(records_on(cuda, load)) == 1
            for layer in range(NUM_LAYERS - 1):
                seen = len(cuda.log)
                assert await step(it) is None  # returns while layer `layer` is "running"
                done = records_on(cuda, load)
                assert len(done) == layer + 2  # layer + 1 queued before the step returned
                waits = [entry for entry in cuda.log[seen:] if entry[:2] == ("wait", "default")]
                assert waits == [("wait", "default", done[layer])]
            assert cuda.synced == []  # nothing was waited for on the host
        mask = await step(it)  # the last step settles the request: it waits for them all
        assert mask is not None and mask.all()
        assert ("wait", "default", records_on(cuda, load)[-1]) in cuda.log
        with anyio.fail_after(TIMEOUT):
            await it.aclose()
        assert cuda.launches() == Counter({"copy_": NUM_LAYERS, "index_copy_": NUM_LAYERS})
        assert {s for _, s in cuda.ops} == {load}
        scene.assert_target(before, prefix(n, 0, n))


async def test_a_store_step_returns_with_its_layer_still_on_the_link(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store step queues its layer behind a point marked on the caller's stream (after
    that layer's compute) and returns without waiting for the copy; the last step waits
    for them all. One gather kernel and one D2H copy per layer."""
    n = 3 * CHUNK
    scene = Scene("mla", torch.bfloat16, n, seed=31)
    async with open_engine(scene.layout, use_layerwise=True) as engine:
        cuda.count_ops(monkeypatch)
        cuda.synced.clear()
        it = scene.store(engine)
        with cuda.held():
            copy = engine._parts.transfers.lanes(CUDA, Direction.STORE).home.name
            for _ in range(NUM_LAYERS):
                seen = len(cuda.log)
                assert await step(it) is None
                marked = [e for e in cuda.log[seen:] if e[0] == "record" and e[2] == "default"]
                assert marked and ("wait", copy, marked[-1][1]) in cuda.log[seen:]
            assert cuda.synced == []
        assert await step(it) == n
        assert cuda.launches() == Counter({"copy_": NUM_LAYERS, "index_select": NUM_LAYERS})
        before = [t.clone() for t in scene.target]
        mask = await anext_last(scene.retrieve(engine))
        assert mask.all()
        scene.assert_target(before, mask)


async def test_copies_queued_one_layer_ahead_stay_exact_and_in_order(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    scene = Scene("flashinfer", torch.float16, 3 * CHUNK + 2, seed=24)
    copied: list[int] = []
    original = StagedLayers.scatter

    def recording(self: StagedLayers, layer: int, jobs: Any, staging: Any) -> None:
        original(self, layer, jobs, staging)
        copied.append(layer)

    async with open_engine(scene.layout, use_layerwise=True) as engine:
        assert await anext_last(scene.store(engine)) == len(scene.tokens)
        monkeypatch.setattr(StagedLayers, "scatter", recording)
        before = [t.clone() for t in scene.target]
        it = scene.retrieve(engine)
        await step(it)
        assert copied == [0]  # queued before layer 0 is asked for
        for layer in range(NUM_LAYERS):
            result = await step(it)
            assert copied == list(range(min(layer + 2, NUM_LAYERS)))
        assert result is not None and result.all()
        scene.assert_target(before, result)
        used = pool_use(engine)
        it = scene.retrieve(engine)
        await step(it)
        await step(it)
        with anyio.fail_after(TIMEOUT):
            await it.aclose()
        assert pool_use(engine) == used
        assert await engine.clear() == 4 * NUM_LAYERS


@pytest.mark.parametrize("steps", [1, 2, NUM_LAYERS])
async def test_closing_early_waits_for_held_copies_then_returns_everything(
    cuda: FakeCuda, steps: int
) -> None:
    """Nothing goes back to the pool under a copy still queued: closing waits for the
    held events, then every page and reference is returned."""
    scene = Scene("flash_hnd", torch.float32, 3 * CHUNK, seed=32)
    async with open_engine(scene.layout, use_layerwise=True) as engine:
        assert await anext_last(scene.store(engine)) == 3 * CHUNK
        used = pool_use(engine)
        it = scene.retrieve(engine)
        closed = anyio.Event()

        async def close() -> None:
            await it.aclose()
            closed.set()

        with cuda.held():
            for _ in range(steps):
                await step(it)
            with anyio.fail_after(TIMEOUT):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(close)
                    await anyio.wait_all_tasks_blocked()
                    held = not closed.is_set()
                    cuda.release()
        assert held  # it waited for the copies
        assert pool_use(engine) == used
        assert await engine.clear() == 3 * NUM_LAYERS


async def test_a_failed_layer_loads_nothing_and_still_hands_over_what_was_queued(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    scene = Scene("flash_nhd", torch.float16, 2 * CHUNK, seed=33)
    original = StagedLayers.scatter

    def fail_layer_1(self: StagedLayers, layer: int, jobs: Any, staging: Any) -> None:
        if layer == 1:
            raise RuntimeError("device lost")
        original(self, layer, jobs, staging)

    async with open_engine(scene.layout, use_layerwise=True) as engine:
        assert await anext_last(scene.store(engine)) == 2 * CHUNK
        used = pool_use(engine)
        monkeypatch.setattr(StagedLayers, "scatter", fail_layer_1)
        cuda.log.clear()
        steps = [await step(it) for it in [scene.retrieve(engine)] for _ in range(NUM_LAYERS + 1)]
        assert not steps[-1].any()
        assert engine.stats().failed_requests == 1
        assert pool_use(engine) == used
        caller_waits = [e for e in cuda.log if e[:2] == ("wait", "default")]
        assert len(caller_waits) == 1  # layer 0, queued before the failure
