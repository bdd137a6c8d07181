"""SyncCacheEngine: the synchronous facade, used from plain threads, embedded and against
an in-process sidecar (on a thread of its own), whole and layer by layer."""

from __future__ import annotations

import functools
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import pytest
import torch

from lmcache_async import (
    EngineClosedError,
    EngineConfig,
    InvalidInputError,
    KVLayout,
    SyncCacheEngine,
    TierUnavailableError,
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


def new_threads(before: set[threading.Thread], grace: float = 10.0) -> list[threading.Thread]:
    """Threads started since ``before`` still alive after ``grace`` seconds: the loop's
    idle worker threads are told to stop when it closes, and exit right after."""
    deadline = time.monotonic() + grace
    for thread in threading.enumerate():
        if thread not in before:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
    return [t for t in threading.enumerate() if t not in before and t.is_alive()]


def test_round_trip_and_close_stops_the_thread() -> None:
    before = set(threading.enumerate())
    engine = SyncCacheEngine.open(config(), LAYOUT, model_name="sync")
    assert new_threads(before, grace=0), "the engine runs its event loop in its own thread"
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


def test_call_timeout_bounds_a_stuck_call() -> None:
    with SyncCacheEngine.open(config(), LAYOUT, model_name="sync", call_timeout=0.2) as engine:
        began = time.monotonic()
        with pytest.raises(TierUnavailableError, match=r"sleep did not finish within 0\.2 s"):
            engine._call(anyio.sleep, 30)
        assert time.monotonic() - began < 5
        # A loop blocked by a synchronous call cannot cancel it: the caller gives up anyway,
        # while the call still blocks the engine's thread (it would return after a minute).
        release, returned = threading.Event(), threading.Event()

        def stuck() -> None:
            release.wait(60)
            returned.set()

        try:
            with pytest.raises(TierUnavailableError, match="thread did not finish stuck"):
                engine._call(stuck)
            assert not returned.is_set()
        finally:
            release.set()
        round_trip(engine, seed=4, n=2 * CHUNK)  # the engine lives on
    with pytest.raises(InvalidInputError, match="call_timeout"):
        SyncCacheEngine.open(config(), LAYOUT, model_name="sync", call_timeout=0)


# -- layerwise, stepped from this thread ------------------------------------------------------


def layerwise_config() -> EngineConfig:
    return EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01, use_layerwise=True)


def test_layerwise_steps_move_one_layer_per_step() -> None:
    gen = torch.Generator().manual_seed(8)
    n = 2 * CHUNK + 3
    tokens = [int(t) for t in torch.randint(0, 50_000, (n,), generator=gen)]
    source, target = caches(8), caches(9)
    src_slots = torch.randperm(NUM_SLOTS, generator=gen)[:n]
    dst_slots = torch.randperm(NUM_SLOTS, generator=gen)[:n]
    before = [t.clone() for t in target]
    with SyncCacheEngine.open(layerwise_config(), LAYOUT, model_name="sync") as engine:
        with engine.store_layer(tokens, kv_caches=source, slot_mapping=src_slots) as store:
            assert store.total == LAYOUT.num_layers + 1
            assert [store.step() for _ in range(LAYOUT.num_layers)] == [None, None]
            assert store.step() == n  # every chunk, the short last one too
            assert store.done
            with pytest.raises(InvalidInputError, match="no step left"):
                store.step()
        assert engine.lookup(tokens) == n
        retrieve = engine.retrieve_layer(tokens, kv_caches=target, slot_mapping=dst_slots)
        assert retrieve.step() is None  # the lookup: nothing copied yet
        assert all(same_bits(t, b) for t, b in zip(target, before, strict=True))
        assert retrieve.step() is None  # layer 0 is in, layer 1 not yet
        slot0, src0 = int(dst_slots[0]), int(src_slots[0])
        assert same_bits(token_kv(target[0], slot0), token_kv(source[0], src0))
        assert same_bits(target[1], before[1])
        mask = retrieve.finish()
        assert isinstance(mask, torch.Tensor)
        assert mask.tolist() == [True] * n
        for i in range(n):
            for got, src in zip(target, source, strict=True):
                dst, at = int(dst_slots[i]), int(src_slots[i])
                assert same_bits(token_kv(got, dst), token_kv(src, at))
        assert engine.stats().pinned_chunks == 0


def test_the_callers_stream_is_taken_on_the_callers_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine runs each call on its own thread, whose current CUDA stream is not the
    caller's: store, retrieve and both layerwise transfers are handed the stream taken on
    the calling thread. CPU caches ignore it (here a stand-in, to see it pass through)."""
    from lmcache_async.sync import calls as sync_calls

    taken_on: list[int] = []
    caller_side = object()  # stands in for the caller's torch.cuda.Stream

    def current_stream(kv_caches: object) -> object:
        taken_on.append(threading.get_ident())
        return caller_side

    monkeypatch.setattr(sync_calls, "current_stream", current_stream)
    n = 2 * CHUNK
    tokens = list(range(7000, 7000 + n))
    source, target = caches(40), caches(41)
    slots = torch.arange(n)
    handed: list[tuple[str, object, int]] = []
    with SyncCacheEngine.open(layerwise_config(), LAYOUT, model_name="sync") as engine:
        for name in ("store", "retrieve", "store_layer", "retrieve_layer"):
            original = getattr(engine.engine, name)

            def recorder(*args: Any, _name: str = name, _fn: Any = original, **kw: Any) -> Any:
                handed.append((_name, kw.get("stream"), threading.get_ident()))
                return _fn(*args, **kw)

            monkeypatch.setattr(engine.engine, name, recorder)
        assert engine.store(tokens, kv_caches=source, slot_mapping=slots) == n
        assert bool(engine.retrieve(tokens, kv_caches=target, slot_mapping=slots).all())
        assert engine.store_layer(tokens, kv_caches=source, slot_mapping=slots).finish() == n
        mask = engine.retrieve_layer(tokens, kv_caches=target, slot_mapping=slots).finish()
        assert isinstance(mask, torch.Tensor) and bool(mask.all())
        # A stream the caller names is handed on as it is.
        named = object()
        engine.store(tokens, kv_caches=source, slot_mapping=slots, stream=named)
    here = threading.get_ident()
    assert taken_on == [here] * 4
    assert [(name, stream) for name, stream, _ in handed] == [
        ("store", caller_side),
        ("retrieve", caller_side),
        ("store_layer", caller_side),
        ("retrieve_layer", caller_side),
        ("store", named),
    ]
    assert all(thread != here for _, _, thread in handed)  # run on the engine's thread


def test_closing_layerwise_steps_midway_returns_the_memory() -> None:
    tokens = list(range(3 * CHUNK))
    kv = caches(11)
    slots = torch.arange(3 * CHUNK)
    with SyncCacheEngine.open(layerwise_config(), LAYOUT, model_name="sync") as engine:
        idle = engine.stats().pool.used_bytes
        store = engine.store_layer(tokens, kv_caches=kv, slot_mapping=slots)
        store.step()
        assert engine.stats().pool.used_bytes > idle  # every chunk's layers allocated
        store.close()
        assert store.done
        assert engine.stats().pool.used_bytes == idle
        assert engine.lookup(tokens) == 0  # nothing was stored
        engine.store_layer(tokens, kv_caches=kv, slot_mapping=slots).finish()
        stored = engine.stats().pool.used_bytes
        retrieve = engine.retrieve_layer(tokens, kv_caches=caches(12), slot_mapping=slots)
        retrieve.step()
        retrieve.step()
        # Left open: close() of the engine closes it first.
    assert retrieve.done
    assert stored > idle


def test_layerwise_lookups_served_to_a_scheduler_count_the_disk(tmp_path: Path) -> None:
    from lmcache_async.rpc.lookup import SyncLookupClient

    tokens = list(range(3 * CHUNK))
    slots = torch.arange(3 * CHUNK)
    disk = EngineConfig(
        chunk_size=CHUNK,
        max_local_cpu_size=0.01,
        use_layerwise=True,
        local_disk=str(tmp_path / "disk"),
        wait_for_slow_tiers=True,
    )
    with SyncCacheEngine.open(disk, LAYOUT, model_name="sync") as engine:
        assert engine.store_layer(tokens, kv_caches=caches(13), slot_mapping=slots).finish() == 48
    # A fresh engine on the same disk: nothing in its CPU tier, every chunk on disk.
    with SyncCacheEngine.open(disk, LAYOUT, model_name="sync") as engine:
        engine.serve_lookups("layerwise-hook", 0, str(tmp_path))
        with SyncLookupClient("layerwise-hook", 1, socket_dir=str(tmp_path), timeout=5) as client:
            assert client.lookup(tokens, lookup_id="r", pin=True) == 3 * CHUNK
        target = caches(14)
        mask = engine.retrieve_layer(
            tokens, kv_caches=target, slot_mapping=slots, lookup_id="r"
        ).finish()
        assert isinstance(mask, torch.Tensor) and bool(mask.all())
        for got, want in zip(target, caches(13), strict=True):
            assert same_bits(got[:, :3], want[:, :3])  # blocks 0-2: the 48 slots written
        assert engine.stats().pinned_chunks == 0


# -- against a sidecar -------------------------------------------------------------------------


@pytest.fixture
def sidecar_url() -> Iterator[str]:
    """An in-process sidecar on its own thread (chunks of CHUNK tokens)."""
    from lmcache_async.rpc.sidecar import SidecarServer, SidecarSettings, serve

    directory = tempfile.mkdtemp(prefix="lmc-se-", dir="/tmp")
    url = f"ipc://{directory}/sidecar.sock"
    settings = SidecarSettings(listen=url, config=config(), heartbeat_interval=0.2)
    servers: list[SidecarServer] = []
    ready = threading.Event()

    def on_ready(server: SidecarServer) -> None:
        servers.append(server)
        ready.set()

    try:
        with anyio.from_thread.start_blocking_portal("asyncio") as portal:
            done = portal.start_task_soon(
                functools.partial(serve, settings, on_ready=on_ready, handle_signals=False)
            )
            assert ready.wait(30), "the sidecar did not start"
            try:
                yield url
            finally:
                portal.call(servers[0].stopping.set)
                done.result(timeout=30)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_sidecar_round_trip_and_lookups_through_the_worker(
    sidecar_url: str, tmp_path: Path
) -> None:
    from lmcache_async.rpc.lookup import SyncLookupClient

    with SyncCacheEngine.connect(sidecar_url, LAYOUT, model_name="sync", timeout=5) as engine:
        assert engine.is_remote
        assert engine.chunk_size == CHUNK
        round_trip(engine, seed=21, n=3 * CHUNK)
        tokens = list(range(1000, 1000 + 2 * CHUNK))
        kv = caches(22)
        assert engine.store(tokens, kv_caches=kv, slot_mapping=torch.arange(2 * CHUNK)) == 32
        engine.serve_lookups("sidecar-hook", 0, str(tmp_path))
        with SyncLookupClient("sidecar-hook", 1, socket_dir=str(tmp_path), timeout=5) as client:
            assert client.lookup(tokens) == 2 * CHUNK
            assert client.lookup(tokens, lookup_id="q", pin=True) == 2 * CHUNK
            assert engine.sidecar_stats()["engine"]["pinned_chunks"] == 2
            client.unpin("q")
            assert engine.sidecar_stats()["engine"]["pinned_chunks"] == 0
            (answer,) = client.stats()
            assert answer is not None and answer["sidecar"] == sidecar_url
        with pytest.raises(InvalidInputError, match="sidecar_stats"):
            engine.stats()
        with pytest.raises(InvalidInputError, match="not offered over the sidecar"):
            engine.store_layer(tokens, kv_caches=kv, slot_mapping=torch.arange(2 * CHUNK))
        with pytest.raises(InvalidInputError, match="not offered over the sidecar"):
            engine.take_events()
    with pytest.raises(EngineClosedError):
        engine.lookup(tokens)


def test_no_sidecar_means_prompt_misses() -> None:
    directory = tempfile.mkdtemp(prefix="lmc-se-", dir="/tmp")
    url = f"ipc://{directory}/nobody.sock"
    tokens = list(range(2 * CHUNK))
    kv = caches(30)
    slots = torch.arange(2 * CHUNK)
    try:
        began = time.monotonic()
        with SyncCacheEngine.connect(url, LAYOUT, model_name="sync", timeout=0.3) as engine:
            assert engine.chunk_size is None
            assert engine.call_timeout == pytest.approx(0.9)
            assert engine.store(tokens, kv_caches=kv, slot_mapping=slots) == 0
            assert engine.lookup(tokens) == 0
            assert not bool(engine.retrieve(tokens, kv_caches=kv, slot_mapping=slots).any())
            assert not engine.is_healthy()
        assert time.monotonic() - began < 10
    finally:
        shutil.rmtree(directory, ignore_errors=True)
