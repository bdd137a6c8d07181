"""The request core's load phases: the run it reserves, release, and what finish ends."""

from __future__ import annotations

import anyio
import pytest

from lmcache_async.core import LoadCore
from lmcache_async.core.load import SLOW_READ_BATCH_BYTES, read_batch_chunks
from tests.core.test_store import CHUNK, TIMEOUT, Scene

pytestmark = pytest.mark.anyio


def load_core(scene: Scene) -> LoadCore:
    return LoadCore(
        scene.manager,
        scene.counters,
        batch_chunks=2,
        timeout=TIMEOUT,
        healthy=lambda: True,
        pins_changed=lambda: None,
    )


async def stored(scene: Scene, count: int) -> None:
    core = scene.core
    txn = core.begin("s", scene.spans[:count], None, limit=10**9, locations=None)
    await core.commit(txn, txn.todo, await core.reserve(txn, txn.todo))
    core.finish(txn)


async def test_reserve_gives_the_leading_run_and_release_returns_it() -> None:
    scene = Scene(8)
    load = load_core(scene)
    keys = [span.key for span in scene.spans]
    with anyio.fail_after(TIMEOUT):
        await stored(scene, 3)
        assert await load.begin(None)
        objs = await load.reserve(keys, None)
        assert len(objs) == 3
        assert all(obj.ref_count == 2 for obj in objs)  # the tier's and the load's
        load.release(objs)
        assert all(obj.ref_count == 1 for obj in objs)
        load.finish(None, 3 * CHUNK)
    assert scene.counters.retrieve_requests == 1
    assert scene.counters.retrieved_tokens == 3 * CHUNK
    assert load.findable(keys, None) == 3


async def test_finish_drops_the_lookup_pins() -> None:
    scene = Scene(8)
    load = load_core(scene)
    keys = [span.key for span in scene.spans]
    with anyio.fail_after(TIMEOUT):
        await stored(scene, 2)
        assert scene.manager.pin_prefix(keys, "r1") == 2
        assert scene.manager.pinned_chunks == 2
        load.finish("r1", 0)
    assert scene.manager.pinned_chunks == 0


async def test_an_unhealthy_cache_serves_no_load() -> None:
    scene = Scene(2)
    load = LoadCore(
        scene.manager,
        scene.counters,
        batch_chunks=2,
        timeout=TIMEOUT,
        healthy=lambda: False,
        pins_changed=lambda: None,
    )
    assert not await load.begin(None)
    assert scene.counters.retrieve_requests == 1


def test_read_batches_hold_a_few_mib_of_chunks() -> None:
    assert read_batch_chunks(8, 3 << 20) == 2
    assert read_batch_chunks(8, 64 << 10) == 8  # never more than a batch
    assert read_batch_chunks(8, 64 << 20) == 1  # never none
    assert read_batch_chunks(8, SLOW_READ_BATCH_BYTES // 3) == 3


async def test_a_load_reads_from_slow_tiers_in_read_batches() -> None:
    """The run the CPU tier holds goes in batches of ``batch_chunks``, what a slow tier
    must be read for in batches of ``read_batch``: each is copied out while the next one
    is read."""
    scene = Scene(8)
    load = LoadCore(
        scene.manager,
        scene.counters,
        batch_chunks=4,
        read_batch=2,
        timeout=TIMEOUT,
        healthy=lambda: True,
        pins_changed=lambda: None,
    )
    keys = [span.key for span in scene.spans]
    with anyio.fail_after(TIMEOUT):
        await stored(scene, 1)
    assert load.batches(keys, load.findable(keys, None), None) == [range(1)]
    scene.manager.reads_slow_tiers = lambda locations: True  # type: ignore[method-assign]
    assert load.findable(keys, None) == 5
    assert load.batches(keys, 5, None) == [range(1), range(1, 3), range(3, 5)]
    assert load.batches(keys, 4, None, read_batch=1) == [range(i, i + 1) for i in range(4)]
    with anyio.fail_after(TIMEOUT):
        await stored(scene, 5)
    assert load.batches(keys, 5, None) == [range(4), range(4, 5)]


async def test_a_prefetch_waited_for_keeps_its_pins_for_the_load_until_dropped() -> None:
    scene = Scene(8)
    load = load_core(scene)
    keys = [span.key for span in scene.spans]
    with anyio.fail_after(TIMEOUT):
        await stored(scene, 3)
        async with anyio.create_task_group() as tg:
            load.start(tg)
            assert load.prefetch(keys[:3], None, "ahead") is not None
            await load.wait_prefetch("ahead")
            forgotten = load.prefetching("ahead") is None
            pinned = scene.manager.pinned_chunks
            objs = await load.reserve(keys[:3], None, "ahead")  # from what it pinned
            load.drop_prefetch("ahead")
            after_drop = scene.manager.pinned_chunks
            load.release(objs)
            # Dropped while still reading: it pins nothing afterwards.
            started = load.prefetch(keys[:3], None, "late")
            load.drop_prefetch("late")
            assert started is not None
            await started.done.wait()
    assert forgotten and pinned == 3 and len(objs) == 3
    assert after_drop == 0
    assert scene.manager.pinned_chunks == 0 and load.prefetching("late") is None
