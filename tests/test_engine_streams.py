"""The stream a caller names reaches the copies: through every request of the engine
(store, retrieve, and both layer by layer), a copy runs on the engine's copy stream after
the point recorded on the caller's stream when the call was made, and a load's copies come
before what the caller queues there next. Not the caller's current stream, not one taken
later: the one it named.

On a machine without a GPU the streams and events are stand-ins (:mod:`tests.fake_cuda`)
that log each wait and record, and the caches, on the CPU, are reported to be on a CUDA
device: the engine takes its CUDA path and the bytes are copied by the CPU plan itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Final

import anyio
import pytest
import torch

from lmcache_async import CacheEngine, EngineConfig, InvalidInputError
from lmcache_async.transfer.cuda import Transfers
from lmcache_async.transfer.plan import TransferPlan
from tests.fake_cuda import CUDA, FakeCuda, install
from tests.test_engine import (
    CHUNK,
    TIMEOUT,
    Scene,
    assert_same_caches,
    clone_caches,
    expected_target,
)

pytestmark = pytest.mark.anyio

N: Final = 3 * CHUNK  # three whole chunks: one copy per request (per layer, layerwise)
NUM_LAYERS: Final = 2
COPIES: Final = (
    "gather_chunks",
    "scatter_chunks",
    "gather_layer_chunks",
    "scatter_layer_chunks",
)


def on_fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """Stand-in streams and events, caches that report a CUDA device, and each copy
    logged with the stream current where it runs (``("copy", method, stream)``)."""
    cuda = install(monkeypatch)
    monkeypatch.setattr(TransferPlan, "device", property(lambda plan: CUDA))
    # The staged copies' buffer lives on the device: the plan's own copies stand in.
    monkeypatch.setattr(Transfers, "staging", lambda self, device, direction: None)
    for name in COPIES:
        monkeypatch.setattr(TransferPlan, name, _logged(cuda, name, getattr(TransferPlan, name)))
    return cuda


def _logged(cuda: FakeCuda, name: str, copy: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(copy)
    def logged(plan: TransferPlan, *args: Any, **kwargs: Any) -> None:
        cuda.log.append(("copy", name, cuda.current_stream().name))
        copy(plan, *args, **kwargs)

    return logged


def copies_of(log: Sequence[tuple[str, ...]], caller: str) -> list[tuple[str, str, frozenset[str]]]:
    """Each copy in ``log`` as ``(method, stream, points)``: ``points`` are the events
    recorded on the caller's stream that the copy's stream waited for since its previous
    copy. Checked here: the copy ran on a stream that is not the caller's and that waited
    for at least one such point."""
    recorded: dict[str, str] = {}  # event -> the stream it was last recorded on
    waited: dict[str, set[str]] = {}  # stream -> caller points waited for since its last copy
    out: list[tuple[str, str, frozenset[str]]] = []
    for entry in log:
        if entry[0] == "record":
            recorded[entry[1]] = entry[2]
        elif entry[0] == "wait" and recorded.get(entry[2]) == caller:
            waited.setdefault(entry[1], set()).add(entry[2])
        elif entry[0] == "copy":
            _, method, stream = entry
            points = frozenset(waited.pop(stream, set()))
            assert stream != caller, f"{method} ran on the caller's stream"
            assert points, f"{method} on {stream} waited for no point of {caller}: {log}"
            out.append((method, stream, points))
    return out


def consumed_by(log: Sequence[tuple[str, ...]], caller: str) -> list[str]:
    """The streams whose events the caller's stream waited for in ``log`` (a load's
    copies)."""
    recorded = {entry[1]: entry[2] for entry in log if entry[0] == "record"}
    return [recorded[entry[2]] for entry in log if entry[0] == "wait" and entry[1] == caller]


def config(**changes: Any) -> EngineConfig:
    return EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01, **changes)


def assert_loaded_exactly(scene: Scene, before: list[torch.Tensor], loaded: torch.Tensor) -> None:
    """The target caches hold the source's KV where ``loaded`` and are untouched elsewhere."""
    want = expected_target(
        scene.kind,
        before=before,
        source=scene.source,
        src_slots=scene.src_slots,
        dst_slots=scene.dst_slots,
        loaded=loaded,
    )
    assert_same_caches(scene.kind, scene.target, want)


async def test_a_store_and_a_retrieve_copy_after_the_point_on_the_stream_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scene = Scene.build("flash_nhd", torch.float16, N, seed=31)
    before = clone_caches(scene.target)
    cuda = on_fake_cuda(monkeypatch)
    caller: Any = cuda.Stream(name="caller")  # a torch.cuda.Stream, as installed
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(config(), scene.layout, model_name="streams") as engine:
            stored = await engine.store(
                scene.tokens, kv_caches=scene.source, slot_mapping=scene.src_slots, stream=caller
            )
            store_log = list(cuda.log)
            cuda.log.clear()
            loaded = await engine.retrieve(
                scene.tokens, kv_caches=scene.target, slot_mapping=scene.dst_slots, stream=caller
            )
            load_log = list(cuda.log)
    assert stored == N
    ((store_method, store_stream, _),) = copies_of(store_log, "caller")
    ((load_method, load_stream, _),) = copies_of(load_log, "caller")
    assert (store_method, load_method) == ("gather_chunks", "scatter_chunks")
    assert store_stream != load_stream  # one copy stream per direction
    assert consumed_by(store_log, "caller") == []  # a store hands the caller nothing
    assert consumed_by(load_log, "caller") == [load_stream]
    assert loaded.tolist() == [True] * N
    assert_loaded_exactly(scene, before, loaded)


async def test_layer_by_layer_copies_after_the_point_on_the_stream_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scene = Scene.build("flash_nhd", torch.float16, N, seed=32)
    before = clone_caches(scene.target)
    cuda = on_fake_cuda(monkeypatch)
    caller: Any = cuda.Stream(name="caller")  # a torch.cuda.Stream, as installed
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(
            config(use_layerwise=True), scene.layout, model_name="streams"
        ) as engine:
            steps = [
                step
                async for step in engine.store_layer(
                    scene.tokens,
                    kv_caches=scene.source,
                    slot_mapping=scene.src_slots,
                    stream=caller,
                )
            ]
            store_log = list(cuda.log)
            cuda.log.clear()
            loads = [
                step
                async for step in engine.retrieve_layer(
                    scene.tokens,
                    kv_caches=scene.target,
                    slot_mapping=scene.dst_slots,
                    stream=caller,
                )
            ]
            load_log = list(cuda.log)
    assert steps == [None] * NUM_LAYERS + [N]
    stores, retrieves = copies_of(store_log, "caller"), copies_of(load_log, "caller")
    assert [method for method, _, _ in stores] == ["gather_layer_chunks"] * NUM_LAYERS
    assert [method for method, _, _ in retrieves] == ["scatter_layer_chunks"] * NUM_LAYERS
    # A store step's copy follows a point marked at that step (after the caller's compute
    # of its layer); a load's layers all follow the point of the call.
    assert len({points for _, _, points in stores}) == NUM_LAYERS
    assert len({points for _, _, points in retrieves}) == 1
    # A store step hands the caller nothing; a load's layer is handed to the caller's
    # stream on the device (it waits for that layer's event), never by a host wait.
    assert consumed_by(store_log, "caller") == []
    load_stream = retrieves[0][1]
    assert consumed_by(load_log, "caller") == [load_stream] * NUM_LAYERS
    loaded = loads[-1]
    assert isinstance(loaded, torch.Tensor) and loaded.tolist() == [True] * N
    assert_loaded_exactly(scene, before, loaded)


async def test_a_stream_not_of_the_caches_device_is_refused_before_any_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scene = Scene.build("flash_nhd", torch.float16, N, seed=33)
    before = clone_caches(scene.target)
    cuda = on_fake_cuda(monkeypatch)
    elsewhere = cuda.Stream(name="elsewhere")
    elsewhere.device = torch.device("cuda", 1)
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(config(), scene.layout, model_name="streams") as engine:
            streams: list[Any] = [object(), elsewhere]
            for stream in streams:
                with pytest.raises(InvalidInputError, match=r"torch\.cuda\.Stream"):
                    await engine.store(
                        scene.tokens,
                        kv_caches=scene.source,
                        slot_mapping=scene.src_slots,
                        stream=stream,
                    )
                with pytest.raises(InvalidInputError, match=r"torch\.cuda\.Stream"):
                    await engine.retrieve(
                        scene.tokens,
                        kv_caches=scene.target,
                        slot_mapping=scene.dst_slots,
                        stream=stream,
                    )
            assert await engine.lookup(scene.tokens) == 0
    assert not [entry for entry in cuda.log if entry[0] == "copy"]
    assert_same_caches(scene.kind, scene.target, before)
