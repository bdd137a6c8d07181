"""The caller's stream: taken on the caller's side, ignored for CPU caches, and on a GPU the
order it gives (a store sees the caller's last write on its stream, a load lands after the
caller's pending work and before its next), the vLLM GPU flash-attention packing too."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import anyio
import pytest
import torch

from lmcache_async import (
    CacheEngine,
    EngineConfig,
    InvalidInputError,
    KVLayout,
    RemoteCacheEngine,
    SyncCacheEngine,
)
from lmcache_async.layouts import CpuKVPacking
from lmcache_async.transfer.cuda_streams import caller_stream, current_stream
from tests.fake_cuda import CUDA, install

pytestmark = pytest.mark.anyio

CHUNK: Final = 16
BLOCK_SIZE: Final = 16
NUM_BLOCKS: Final = 16
TIMEOUT: Final = 30
SPIN: Final = 200_000_000
"""GPU cycles of the kernel that keeps the caller's stream busy (about 0.1 s): without the
ordering, a copy would run before the write queued behind it."""

LAYOUT: Final = KVLayout.vllm_flash_attn(
    num_layers=2, block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.float16
)
TOKEN_ROWS: Final = KVLayout.vllm_cpu(
    num_layers=2,
    num_kv_heads=2,
    head_size=32,
    dtype=torch.bfloat16,
    block_size=BLOCK_SIZE,
    packing=CpuKVPacking.TOKEN_ROWS,
)


def config(**changes: Any) -> EngineConfig:
    return EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.02, **changes)


def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test on any call of torch.cuda's streams and events."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("torch.cuda was called for CPU caches")

    for name in ("current_stream", "Event", "stream", "Stream"):
        monkeypatch.setattr(torch.cuda, name, refuse)


# ---------------------------------------------------------------------- without a GPU


def test_no_cuda_call_is_made_for_cpu_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    no_cuda(monkeypatch)
    cpu = LAYOUT.allocate_kv_caches(2, random=False)
    assert caller_stream(torch.device("cpu"), object()) is None  # ignored, not checked
    assert current_stream(cpu) is None
    for other in ([], (), None, "kv", cpu[0], [object()]):
        assert current_stream(other) is None


def test_the_point_on_the_callers_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = install(monkeypatch)
    # By default the current stream; the plan was built there too.
    point = caller_stream(CUDA)
    assert point is not None and point.stream is cuda.default
    ready = cuda.log[-1][1]
    assert cuda.log == [("record", ready, "default")]
    copy = cuda.Stream(name="copy")
    point.order(copy)
    assert cuda.log[-1] == ("wait", "copy", ready)
    # Another stream: the plan, built on the current one, is waited for as well.
    side = cuda.Stream(name="side")
    cuda.log.clear()
    point = caller_stream(CUDA, side)
    assert point is not None and point.stream is side
    recorded = {stream: event for _, event, stream in cuda.log}
    built = recorded["default"]
    # A layerwise store step marks a new point on the same stream; the plan's is kept.
    later = point.mark()
    kind, marked, stream = cuda.log[-1]
    assert (kind, stream) == ("record", "side") and marked != recorded["side"]
    cuda.log.clear()
    later.order(copy)
    assert cuda.log == [("wait", "copy", marked), ("wait", "copy", built)]
    # A load's copies come before the caller's next work, unless a step hands them over.
    done = cuda.Event()
    cuda.log.clear()
    point.handed_over().consume(done)
    assert cuda.log == []
    point.consume(done)
    assert cuda.log == [("wait", "side", done.name)]
    with pytest.raises(InvalidInputError, match=r"torch\.cuda\.Stream"):
        caller_stream(CUDA, object())
    elsewhere = cuda.Stream(name="elsewhere")
    elsewhere.device = torch.device("cuda", 1)
    with pytest.raises(InvalidInputError, match=r"torch\.cuda\.Stream"):
        caller_stream(CUDA, elsewhere)


async def test_cpu_caches_take_and_ignore_a_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 2 * CHUNK
    tokens = list(range(3000, 3000 + n))
    source = LAYOUT.allocate_kv_caches(NUM_BLOCKS, generator=torch.Generator().manual_seed(1))
    target = LAYOUT.allocate_kv_caches(NUM_BLOCKS, random=False)
    slots = torch.arange(n)
    anything = object()  # not even a stream: CPU caches never look at it
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(
            config(use_layerwise=True), LAYOUT, model_name="streams"
        ) as engine:
            no_cuda(monkeypatch)
            kw: dict[str, Any] = {"slot_mapping": slots, "stream": anything}
            assert await engine.store(tokens, kv_caches=source, **kw) == n
            assert bool((await engine.retrieve(tokens, kv_caches=target, **kw)).all())
            steps = [step async for step in engine.store_layer(tokens, kv_caches=source, **kw)]
            assert steps[-1] == n
            steps = [step async for step in engine.retrieve_layer(tokens, kv_caches=target, **kw)]
            assert isinstance(steps[-1], torch.Tensor) and bool(steps[-1].all())
            monkeypatch.undo()
    assert torch.equal(tokens_of(LAYOUT, target, slots), tokens_of(LAYOUT, source, slots))


async def test_a_sidecar_client_takes_and_ignores_a_stream_for_cpu_caches(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = LAYOUT.allocate_kv_caches(2, random=False)
    url = f"ipc://{tmp_path}/nobody.sock"
    with anyio.fail_after(TIMEOUT):
        async with RemoteCacheEngine.connect(
            url, LAYOUT, model_name="streams", timeout=0.3, require_server=False
        ) as client:
            no_cuda(monkeypatch)
            kw: dict[str, Any] = {"slot_mapping": torch.arange(CHUNK), "stream": object()}
            assert await client.store(list(range(CHUNK)), kv_caches=kv, **kw) == 0
            assert not bool((await client.retrieve(list(range(CHUNK)), kv_caches=kv, **kw)).any())
            monkeypatch.undo()


# ---------------------------------------------------------------------- on a GPU


def on_device(layout: KVLayout, seed: int) -> list[torch.Tensor]:
    cpu = layout.allocate_kv_caches(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))
    return [t.cuda() for t in cpu]


def tokens_of(layout: KVLayout, kv: Sequence[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """The payload of ``slots``' tokens in ``kv`` (copied to the host), as raw bits."""
    out = torch.empty(layout.payload_shape(len(slots)), dtype=layout.dtype)
    layout.gather([t.cpu() for t in kv], slots.cpu(), out)
    return out.view(torch.int16)


def scene(seed: int, n: int = 4 * CHUNK) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = [seed * 100_000 + int(t) for t in torch.randint(0, 50_000, (n,), generator=gen)]
    perm = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)
    return tokens, perm[:n], perm[n : 2 * n]


def pool_buffer(unpinned: bool) -> memoryview | None:
    """An arena the engine cannot pin (as a shared-memory segment is), or None."""
    return memoryview(bytearray(16 << 20)) if unpinned else None


@pytest.mark.cuda
@pytest.mark.parametrize("unpinned", [False, True], ids=["pinned", "unpinned"])
@pytest.mark.parametrize("named", [True, False], ids=["named", "current"])
async def test_a_store_sees_the_callers_last_write_on_its_stream(
    unpinned: bool, named: bool
) -> None:
    tokens, slots, dst = scene(51)
    want = on_device(LAYOUT, 52)
    kv = [torch.zeros_like(t) for t in want]
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(
            config(), LAYOUT, model_name="streams", pool_buffer=pool_buffer(unpinned)
        ) as engine:
            with torch.cuda.stream(side):
                torch.cuda._sleep(SPIN)  # the write below lands late
                for layer, values in zip(kv, want, strict=True):
                    layer.copy_(values)
            if named:
                stored = await engine.store(tokens, kv_caches=kv, slot_mapping=slots, stream=side)
            else:
                with torch.cuda.stream(side):
                    stored = await engine.store(tokens, kv_caches=kv, slot_mapping=slots)
            assert stored == len(tokens)
            target = [torch.zeros_like(t) for t in want]
            loaded = await engine.retrieve(tokens, kv_caches=target, slot_mapping=dst)
            assert bool(loaded.all())
    torch.cuda.synchronize()
    assert torch.equal(tokens_of(LAYOUT, target, dst), tokens_of(LAYOUT, want, slots))


@pytest.mark.cuda
@pytest.mark.parametrize("unpinned", [False, True], ids=["pinned", "unpinned"])
async def test_a_load_comes_after_the_callers_pending_work_and_before_its_next(
    unpinned: bool,
) -> None:
    tokens, slots, dst = scene(53)
    source = on_device(LAYOUT, 54)
    target = [torch.zeros_like(t) for t in source]
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(
            config(), LAYOUT, model_name="streams", pool_buffer=pool_buffer(unpinned)
        ) as engine:
            assert await engine.store(tokens, kv_caches=source, slot_mapping=slots) == len(tokens)
            with torch.cuda.stream(side):
                torch.cuda._sleep(SPIN)
                for layer in target:
                    layer.fill_(-1.0)  # the caller's last write: the load must land on it
            loaded = await engine.retrieve(tokens, kv_caches=target, slot_mapping=dst, stream=side)
            assert bool(loaded.all())
            with torch.cuda.stream(side):
                seen = [layer.clone() for layer in target]  # read where the caller reads
            side.synchronize()
    assert torch.equal(tokens_of(LAYOUT, seen, dst), tokens_of(LAYOUT, source, slots))
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[dst] = False
    rest = tokens_of(LAYOUT, seen, torch.arange(NUM_BLOCKS * BLOCK_SIZE)[untouched])
    assert torch.equal(rest, torch.full_like(rest.view(LAYOUT.dtype), -1.0).view(torch.int16))


@pytest.mark.cuda
def test_the_sync_engine_orders_against_the_calling_threads_stream() -> None:
    """vLLM's path: the forward pass runs on the caller's thread, on its own stream."""
    tokens, slots, dst = scene(55)
    want = on_device(LAYOUT, 56)
    kv = [torch.zeros_like(t) for t in want]
    target = [torch.zeros_like(t) for t in want]
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with SyncCacheEngine.open(config(), LAYOUT, model_name="streams", call_timeout=TIMEOUT) as sync:
        with torch.cuda.stream(side):
            torch.cuda._sleep(SPIN)
            for layer, values in zip(kv, want, strict=True):
                layer.copy_(values)
            assert sync.store(tokens, kv_caches=kv, slot_mapping=slots) == len(tokens)
            torch.cuda._sleep(SPIN)
            for layer in target:
                layer.fill_(-1.0)
            assert bool(sync.retrieve(tokens, kv_caches=target, slot_mapping=dst).all())
            seen = [layer.clone() for layer in target]
        side.synchronize()
    assert torch.equal(tokens_of(LAYOUT, seen, dst), tokens_of(LAYOUT, want, slots))


@pytest.mark.cuda
async def test_a_layerwise_store_step_sees_its_layer_written_on_the_callers_stream() -> None:
    tokens, slots, dst = scene(57)
    want = on_device(LAYOUT, 58)
    kv = [torch.zeros_like(t) for t in want]
    target = [torch.zeros_like(t) for t in want]
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(
            config(use_layerwise=True), LAYOUT, model_name="streams"
        ) as engine:
            steps = engine.store_layer(tokens, kv_caches=kv, slot_mapping=slots, stream=side)
            for layer, values in zip(kv, want, strict=True):
                with torch.cuda.stream(side):  # the layer's "compute"
                    torch.cuda._sleep(SPIN // 4)
                    layer.copy_(values)
                assert await anext(steps) is None
            assert await anext(steps) == len(tokens)
            await steps.aclose()
            loads = engine.retrieve_layer(tokens, kv_caches=target, slot_mapping=dst)
            results = [step async for step in loads]
            assert isinstance(results[-1], torch.Tensor) and bool(results[-1].all())
    torch.cuda.synchronize()
    assert torch.equal(tokens_of(LAYOUT, target, dst), tokens_of(LAYOUT, want, slots))


@pytest.mark.cuda
async def test_token_rows_round_trip_on_cuda() -> None:
    """vLLM 0.32's GPU flash-attention cache (``[blocks, H, block_size, 2 * D]``, a token's
    row its keys then its values) through the engine, whole and layer by layer."""
    n = 3 * CHUNK + 5
    tokens, slots, dst = scene(59, n)
    source = on_device(TOKEN_ROWS, 60)
    assert TOKEN_ROWS.check_kv_caches(source) == NUM_BLOCKS
    want = tokens_of(TOKEN_ROWS, source, slots)
    # The same bytes as vLLM's flash-attention kernel reads them, for one token.
    block, offset = divmod(int(slots[0]), BLOCK_SIZE)
    keys, values = source[0][block, :, offset].cpu().split(TOKEN_ROWS.head_size, dim=-1)
    assert torch.equal(want[0, 0, 0].view(TOKEN_ROWS.dtype), keys.reshape(-1))
    assert torch.equal(want[1, 0, 0].view(TOKEN_ROWS.dtype), values.reshape(-1))
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(
            config(use_layerwise=True), TOKEN_ROWS, model_name="token-rows"
        ) as engine:
            assert await engine.store(tokens, kv_caches=source, slot_mapping=slots.cuda()) == n
            target = [torch.zeros_like(t) for t in source]
            assert bool((await engine.retrieve(tokens, kv_caches=target, slot_mapping=dst)).all())
            torch.cuda.synchronize()
            assert torch.equal(tokens_of(TOKEN_ROWS, target, dst), want)
            steps = [
                s async for s in engine.store_layer(tokens, kv_caches=source, slot_mapping=slots)
            ]
            assert steps[-1] == n
            target = [torch.zeros_like(t) for t in source]
            loads = [
                s async for s in engine.retrieve_layer(tokens, kv_caches=target, slot_mapping=dst)
            ]
            assert isinstance(loads[-1], torch.Tensor) and bool(loads[-1].all())
            torch.cuda.synchronize()
            assert torch.equal(tokens_of(TOKEN_ROWS, target, dst), want)
