"""The lookup service across real processes: a scheduler (this test process) and worker
processes (tests/rpc/lookup_worker.py) over ipc, plus an in-process fake worker for the
request-id and timeout rules and the SyncCacheEngine hook."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import anyio
import numpy as np
import pytest
import structlog
import torch
import zmq
import zmq.asyncio

from lmcache_async import (
    CacheEngine,
    EngineClosedError,
    EngineConfig,
    InvalidInputError,
    KVLayout,
    SyncCacheEngine,
)
from lmcache_async.rpc.lookup import (
    LookupClient,
    LookupServer,
    SyncLookupClient,
    lookup_endpoint,
)
from lmcache_async.rpc.protocol import (
    Message,
    MessageType,
    decode,
    encode,
    tokens_from_payload,
)

CHUNK = 16
PROMPT_LEN = 6 * CHUNK + 5  # 101 tokens: six full chunks and a short one
RANK0_STORES = 5 * CHUNK
RANK1_STORES = 3 * CHUNK
HASHED_TOKENS = 4 * CHUNK + 3


def block_hashes(num_tokens: int) -> tuple[list[int], list[int]]:
    """The same block hashes lookup_worker.py stores with --hash-store."""
    offsets = [*range(CHUNK, num_tokens, CHUNK), num_tokens]
    return [2**200 + i for i in range(len(offsets))], offsets


# -- endpoint names --------------------------------------------------------------------------


def test_endpoint_is_derived_from_instance_id_and_rank(tmp_path: Path) -> None:
    assert lookup_endpoint("vllm-a.1_x", 3, str(tmp_path)) == (
        f"ipc://{tmp_path}/lmcache-async-vllm-a.1_x-3.lookup"
    )
    assert lookup_endpoint("a", 0).startswith("ipc:///")


@pytest.mark.parametrize(
    ("instance_id", "rank", "socket_dir", "match"),
    [
        ("", 0, None, "instance_id"),
        ("a/b", 0, None, "instance_id"),
        ("a b", 0, None, "instance_id"),
        ("x" * 65, 0, None, "instance_id"),
        (7, 0, None, "instance_id"),
        ("a", -1, None, "rank"),
        ("a", True, None, "rank"),
        ("a", 0, "/" + "d" * 120, "longer than 107 bytes"),
    ],
)
def test_bad_endpoint_arguments_are_refused(
    instance_id: Any, rank: Any, socket_dir: str | None, match: str
) -> None:
    with pytest.raises(InvalidInputError, match=match):
        lookup_endpoint(instance_id, rank, socket_dir)


def test_client_arguments_are_checked(tmp_path: Path) -> None:
    bad_settings: list[tuple[dict[str, Any], str]] = [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 1, "timeout": 0}, "timeout"),
        ({"world_size": 1, "timeout": float("inf")}, "timeout"),
        ({"world_size": 1, "timeout": True}, "timeout"),
    ]
    for kwargs, match in bad_settings:
        with pytest.raises(InvalidInputError, match=match):
            SyncLookupClient("a", socket_dir=str(tmp_path), **kwargs)
    with SyncLookupClient("a", 1, socket_dir=str(tmp_path), timeout=0.2) as client:
        bad_calls: list[tuple[Callable[[], object], str]] = [
            (client.lookup, "tokens"),
            (lambda: client.lookup([1], pin=True), "lookup_id"),
            (lambda: client.lookup([1], lookup_id=1.5), "lookup_id"),  # type: ignore[arg-type]
            (lambda: client.lookup([1], hashes=[1], offsets=[1]), "either tokens or hashes"),
            (lambda: client.lookup(hashes=[1]), "offsets"),
            (lambda: client.lookup(hashes=[1.0], offsets=[1]), r"hashes\[0\]"),  # type: ignore[list-item]
            (lambda: client.lookup(hashes=[1], offsets=["1"]), r"offsets\[0\]"),  # type: ignore[list-item]
            (lambda: client.lookup([1, -2]), ">= 0"),
            (lambda: client.lookup([1], offsets=[1]), "offsets go with hashes"),
            (lambda: client.unpin(None), "lookup_id"),  # type: ignore[arg-type]
        ]
        for call, match in bad_calls:
            with pytest.raises(InvalidInputError, match=match):
                call()
        assert client.lookup([]) == 0  # nothing to ask: no round trip, no wait
    with pytest.raises(EngineClosedError):
        client.lookup([1])


# -- two real workers ------------------------------------------------------------------------


WORKER_OPTIONS = ("--hash-store", str(HASHED_TOKENS))


@pytest.fixture(scope="module")
def two_workers(module_workers: Any) -> Any:
    """Rank 0 holds 5 chunks of the prompt, rank 1 holds 3; both hold HASHED_TOKENS keyed
    by block hashes. ``.workers`` are the two processes."""
    module_workers.workers = module_workers(
        "pair", [(0, RANK0_STORES), (1, RANK1_STORES)], *WORKER_OPTIONS, prompt_len=PROMPT_LEN
    )
    return module_workers


@pytest.mark.subprocess
@pytest.mark.anyio
async def test_scheduler_gets_the_minimum_over_two_workers(
    two_workers: Any, prompt_tokens: Callable[[int], list[int]]
) -> None:
    tokens = prompt_tokens(PROMPT_LEN)
    hashes, offsets = block_hashes(HASHED_TOKENS)
    socket_dir = str(two_workers.socket_dir)
    with anyio.fail_after(20):
        async with (
            LookupClient("pair", 2, socket_dir=socket_dir, timeout=5.0) as both,
            LookupClient("pair", 1, socket_dir=socket_dir, timeout=5.0) as rank0_only,
        ):
            assert await both.ping() == [True, True]
            assert await both.lookup(tokens) == RANK1_STORES
            assert await rank0_only.lookup(tokens) == RANK0_STORES
            assert await both.lookup(torch.tensor(tokens)) == RANK1_STORES
            assert await both.lookup(np.array(tokens, dtype=np.int64)) == RANK1_STORES
            assert await both.lookup(tokens[:40]) == 2 * CHUNK  # 40 tokens: a short 3rd chunk
            assert await both.lookup([t + 1 for t in tokens]) == 0
            assert await both.lookup(hashes=hashes, offsets=offsets) == HASHED_TOKENS
            assert await both.lookup(hashes=hashes[:2], offsets=offsets[:2]) == 2 * CHUNK
            other = [hashes[0], 2**200 + 99]
            assert await both.lookup(hashes=other, offsets=offsets[:2]) == CHUNK
            # Concurrent calls on one client each get their own answer.
            lengths = [CHUNK * k + 3 for k in range(7)] * 3
            answers: dict[int, int] = {}

            async def ask(i: int, n: int) -> None:
                answers[i] = await both.lookup(tokens[:n])

            async with anyio.create_task_group() as group:
                for i, n in enumerate(lengths):
                    group.start_soon(ask, i, n)
            expected = [min(n // CHUNK * CHUNK, RANK1_STORES) for n in lengths]
            assert [answers[i] for i in range(len(lengths))] == expected


@pytest.mark.subprocess
def test_sync_client_gets_the_same_answers(
    two_workers: Any, prompt_tokens: Callable[[int], list[int]]
) -> None:
    tokens = prompt_tokens(PROMPT_LEN)
    hashes, offsets = block_hashes(HASHED_TOKENS)
    with SyncLookupClient("pair", 2, socket_dir=str(two_workers.socket_dir), timeout=5.0) as c:
        assert c.ping() == [True, True]
        assert c.lookup(tokens) == RANK1_STORES
        assert c.lookup(np.array(tokens[:70], dtype=np.uint32)) == RANK1_STORES
        assert c.lookup(tokens[:33]) == 2 * CHUNK
        assert c.lookup(hashes=hashes, offsets=offsets) == HASHED_TOKENS
        assert c.lookup([t + 1 for t in tokens]) == 0


@pytest.mark.subprocess
@pytest.mark.anyio
async def test_pin_and_unpin_across_the_wire(
    two_workers: Any, prompt_tokens: Callable[[int], list[int]]
) -> None:
    tokens = prompt_tokens(PROMPT_LEN)
    socket_dir = str(two_workers.socket_dir)
    with anyio.fail_after(20):
        async with LookupClient("pair", 2, socket_dir=socket_dir, timeout=5.0) as client:
            assert [s["pinned_chunks"] for s in await client.stats() if s] == [0, 0]
            assert await client.lookup(tokens, lookup_id="req-1", pin=True) == RANK1_STORES
            assert await client.lookup(tokens[:20], lookup_id=7, pin=True) == CHUNK
            stats = await client.stats()
            assert [s["pinned_chunks"] for s in stats if s] == [5 + 1, 3 + 1]
            assert [s["active_lookup_ids"] for s in stats if s] == [2, 2]
            await client.unpin("req-1")
            stats = await client.stats()
            assert [s["active_lookup_ids"] for s in stats if s] == [1, 1]
            await client.unpin(7)
            await client.unpin("never-pinned")
            stats = await client.stats()
            assert [s["pinned_chunks"] for s in stats if s] == [0, 0]
            assert [s["cached_chunks"] for s in stats if s] == [5 + 5, 3 + 5]
    with SyncLookupClient("pair", 2, socket_dir=socket_dir, timeout=5.0) as sync:
        assert sync.lookup(tokens, lookup_id="s", pin=True) == RANK1_STORES
        assert [s["pinned_chunks"] for s in sync.stats() if s] == [5, 3]
        sync.unpin("s")
        assert [s["pinned_chunks"] for s in sync.stats() if s] == [0, 0]


@pytest.mark.subprocess
@pytest.mark.anyio
async def test_a_rank_refusing_the_input_raises_invalid_input(two_workers: Any) -> None:
    socket_dir = str(two_workers.socket_dir)
    async with LookupClient("pair", 2, socket_dir=socket_dir, timeout=5.0) as client:
        with anyio.fail_after(10), pytest.raises(InvalidInputError, match=r"rank 0: .*chunk_size"):
            await client.lookup(hashes=[1, 2], offsets=[5, 10])  # blocks must be 16 tokens
        with anyio.fail_after(10), pytest.raises(InvalidInputError, match=r"2\*\*31"):
            await client.lookup(np.array([2**31], dtype=np.int64))  # refused before sending
        assert await client.ping() == [True, True]


# -- a worker killed and restarted -----------------------------------------------------------


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.anyio
async def test_killed_worker_counts_as_zero_hits_and_is_found_again_after_restart(
    two_workers: Any, prompt_tokens: Callable[[int], list[int]]
) -> None:
    tokens = prompt_tokens(PROMPT_LEN)
    socket_dir = str(two_workers.socket_dir)
    timeout = 0.5
    async with LookupClient("pair", 2, socket_dir=socket_dir, timeout=timeout) as client:
        sync = SyncLookupClient("pair", 2, socket_dir=socket_dir, timeout=timeout)
        try:
            with anyio.fail_after(10):
                assert await client.lookup(tokens) == RANK1_STORES
            assert sync.lookup(tokens) == RANK1_STORES
            two_workers.workers[1].kill()
            with structlog.testing.capture_logs() as logs:
                calls: list[Callable[[], Awaitable[int]]] = [
                    lambda: client.lookup(tokens),
                    lambda: anyio.to_thread.run_sync(sync.lookup, tokens),
                    lambda: client.lookup(tokens, lookup_id="p", pin=True),
                ]
                # Each call waits for the dead rank at most its timeout: five times that is
                # a bound no busy machine reaches, and a call left waiting would break it.
                for call in calls:
                    with anyio.fail_after(5 * timeout):
                        assert await call() == 0
                with anyio.fail_after(5 * timeout):
                    await client.unpin("p")  # rank 1 is gone: logged, not raised
                with anyio.fail_after(5 * timeout):
                    assert await client.ping() == [True, False]
            timeouts = [e for e in logs if e["event"] == "lookup_rank_timeout"]
            assert {e["rank"] for e in timeouts} == {1}
            assert {e["op"] for e in timeouts} == {"lookup", "unpin", "ping"}

            # The same rank comes back (its old socket file is still there) with the same
            # data; both clients find it again by themselves.
            two_workers.workers[1:] = two_workers(
                "pair", [(1, RANK1_STORES)], *WORKER_OPTIONS, prompt_len=PROMPT_LEN
            )
            with anyio.fail_after(15):
                while (hits := await client.lookup(tokens)) == 0:
                    pass  # each call waits at most `timeout` while zmq reconnects
                assert hits == RANK1_STORES
                while (hits := await anyio.to_thread.run_sync(sync.lookup, tokens)) == 0:
                    pass
                assert hits == RANK1_STORES
        finally:
            sync.close()


# -- a fake worker that replies out of turn --------------------------------------------------


@asynccontextmanager
async def fake_worker(endpoint: str) -> AsyncIterator[zmq.asyncio.Socket]:
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(endpoint)
    try:
        yield socket
    finally:
        socket.close(linger=0)
        context.term()
        await anyio.Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)


async def next_request(socket: zmq.asyncio.Socket) -> tuple[bytes, Message]:
    identity, *frames = await socket.recv_multipart()
    return identity, decode(frames)


def hits_reply(identity: bytes, request_id: Any, hits: int) -> list[Any]:
    return [identity, *encode(MessageType.LOOKUP, {"hits": hits}, request_id=request_id)]


@pytest.mark.anyio
async def test_stale_and_garbage_replies_are_never_taken_as_the_answer(socket_dir: Path) -> None:
    endpoint = lookup_endpoint("fake", 0, str(socket_dir))
    with anyio.fail_after(15):
        async with (
            fake_worker(endpoint) as worker,
            LookupClient("fake", 1, socket_dir=str(socket_dir), timeout=0.3) as client,
        ):
            # 1. The worker stays silent: 0 hits after the timeout.
            async with anyio.create_task_group() as group:
                group.start_soon(next_request, worker)
                assert await client.lookup([1] * 40) == 0
            # 2. Garbage, a reply to an older request and an unknown id come first.
            async with anyio.create_task_group() as group:

                async def answer() -> None:
                    identity, request = await next_request(worker)
                    assert request.type is MessageType.LOOKUP
                    assert tokens_from_payload(request.payloads[0]).tolist() == [2] * 40
                    assert isinstance(request.request_id, int)
                    await worker.send_multipart([identity, b"\x02", b"\xc1"])
                    await worker.send_multipart(hits_reply(identity, request.request_id - 1, 99))
                    await worker.send_multipart(hits_reply(identity, "other", 98))
                    await worker.send_multipart(hits_reply(identity, request.request_id, 32))

                group.start_soon(answer)
                assert await client.lookup([2] * 40) == 32

            # 3. A reply with a bad 'hits' counts as 0.
            async def bad_hits() -> None:
                identity, request = await next_request(worker)
                reply = encode(MessageType.LOOKUP, {"hits": "x"}, request_id=request.request_id)
                await worker.send_multipart([identity, *reply])

            async with anyio.create_task_group() as group:
                group.start_soon(bad_hits)
                assert await client.lookup([3] * 20) == 0


def test_sync_client_drops_stale_replies(socket_dir: Path) -> None:
    endpoint = lookup_endpoint("fake-sync", 0, str(socket_dir))
    context = zmq.Context()
    worker = context.socket(zmq.ROUTER)
    worker.setsockopt(zmq.LINGER, 0)
    worker.bind(endpoint)
    try:
        with SyncLookupClient("fake-sync", 1, socket_dir=str(socket_dir), timeout=5.0) as client:
            result: list[int] = []

            def serve() -> None:
                identity, *frames = worker.recv_multipart()
                request = decode(frames)
                assert isinstance(request.request_id, int)
                worker.send_multipart(hits_reply(identity, request.request_id + 1, 99))
                worker.send_multipart(hits_reply(identity, request.request_id, 16))

            thread = threading.Thread(target=serve)
            thread.start()
            try:
                result.append(client.lookup([5] * 16))
            finally:
                thread.join(timeout=10)
            assert result == [16]
    finally:
        worker.close(linger=0)
        context.term()
        Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)


# -- one server per instance id and rank ----------------------------------------------------

LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=2, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.float16
)
CONFIG = EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01)


@pytest.mark.anyio
async def test_a_second_server_for_the_same_rank_is_refused(socket_dir: Path) -> None:
    directory = str(socket_dir)
    with anyio.fail_after(20):
        async with CacheEngine.open(CONFIG, LAYOUT, model_name="twice") as engine:
            async with LookupServer.serve(
                engine, instance_id="twice", rank=0, socket_dir=directory
            ):
                with pytest.raises(InvalidInputError, match="already serves lookups"):
                    async with LookupServer.serve(
                        engine, instance_id="twice", rank=0, socket_dir=directory
                    ):
                        pass
                # The refused server removed nothing: the first one still answers.
                async with LookupClient("twice", 1, socket_dir=directory) as client:
                    assert await client.ping() == [True]
            async with (
                LookupServer.serve(engine, instance_id="twice", rank=0, socket_dir=directory),
                LookupClient("twice", 1, socket_dir=directory) as client,
            ):
                assert await client.ping() == [True]
            with pytest.raises(InvalidInputError, match="cannot listen"):
                async with LookupServer.serve(
                    engine, instance_id="x", rank=0, socket_dir=f"{directory}/missing"
                ):
                    pass


@pytest.mark.anyio
async def test_a_lookup_names_its_tenant_and_finds_only_that_tenants_chunks(
    socket_dir: Path,
) -> None:
    tokens = list(range(100, 100 + 3 * CHUNK + 5))
    kv = LAYOUT.allocate_kv_caches(4, generator=torch.Generator().manual_seed(1))
    directory = str(socket_dir)
    with anyio.fail_after(20):
        async with CacheEngine.open(CONFIG, LAYOUT, model_name="tenants") as engine:
            slots = torch.arange(len(tokens))
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots, tenant="a") == 53
            async with (
                LookupServer.serve(engine, instance_id="tenants", rank=0, socket_dir=directory),
                LookupClient("tenants", 1, socket_dir=directory, timeout=5.0) as client,
            ):
                assert await client.lookup(tokens, tenant="a") == 53
                assert await client.lookup(tokens, tenant="b") == 0
                assert await client.lookup(tokens) == 0  # the engine's own tenant
                assert await client.lookup(tokens, lookup_id="p", pin=True, tenant="a") == 53
                assert engine.stats().pinned_chunks == 4
                await client.unpin("p")
                assert engine.stats().pinned_chunks == 0
                with pytest.raises(InvalidInputError, match="tenant must be None or a str"):
                    await client.lookup(tokens, tenant=5)  # type: ignore[arg-type]

                def sync_lookups() -> list[int]:
                    with SyncLookupClient("tenants", 1, socket_dir=directory, timeout=5.0) as sync:
                        with pytest.raises(InvalidInputError, match="at most 256 UTF-8 bytes"):
                            sync.lookup(tokens, tenant="x" * 300)
                        return [sync.lookup(tokens, tenant=t) for t in ("a", "b", None)]

                assert await anyio.to_thread.run_sync(sync_lookups) == [53, 0, 0]


class StubEngine:
    """Stands in for a CacheEngine: lookups of 7 tokens wait for ``release``, lookups of 13
    tokens fail, others answer their length."""

    def __init__(self) -> None:
        self.started = anyio.Event()
        self.release = anyio.Event()

    async def lookup(self, tokens: Any = None, **_: Any) -> int:
        if len(tokens) == 7:
            self.started.set()
            await self.release.wait()
        if len(tokens) == 13:
            raise RuntimeError("disk on fire")
        return len(tokens)


@pytest.mark.anyio
async def test_a_slow_lookup_does_not_hold_up_others_and_a_failure_is_an_error_reply(
    socket_dir: Path,
) -> None:
    engine = StubEngine()
    directory = str(socket_dir)
    with anyio.fail_after(10):
        async with (
            LookupServer.serve(
                cast(CacheEngine, engine), instance_id="stub", rank=0, socket_dir=directory
            ),
            LookupClient("stub", 1, socket_dir=directory, timeout=5.0) as slow_client,
            LookupClient("stub", 1, socket_dir=directory, timeout=5.0) as client,
        ):
            results: list[int] = []

            async def slow() -> None:
                results.append(await slow_client.lookup([1] * 7))

            async with anyio.create_task_group() as group:
                group.start_soon(slow)
                await engine.started.wait()
                assert await client.ping() == [True]
                assert await client.lookup([1] * 5) == 5
                assert results == []
                engine.release.set()
            assert results == [7]
            with structlog.testing.capture_logs() as logs:
                assert await client.lookup([1] * 13) == 0
            (error,) = [e for e in logs if e["event"] == "lookup_rank_error"]
            assert error["code"] == "internal"
            assert "RuntimeError: disk on fire" in error["message"]
            assert await client.lookup([1] * 3) == 3


# -- the SyncCacheEngine hook ----------------------------------------------------------------


def test_sync_engine_serves_lookups_until_closed(socket_dir: Path) -> None:
    tokens = list(range(3 * CHUNK))
    engine = SyncCacheEngine.open(CONFIG, LAYOUT, model_name="sync-hook")
    try:
        kv = LAYOUT.allocate_kv_caches(4, generator=torch.Generator().manual_seed(0))
        assert engine.store(tokens, kv_caches=kv, slot_mapping=torch.arange(len(tokens))) == 48
        endpoint = engine.serve_lookups("hook", 0, str(socket_dir))
        assert endpoint == lookup_endpoint("hook", 0, str(socket_dir))
        with SyncLookupClient("hook", 1, socket_dir=str(socket_dir), timeout=0.3) as client:
            assert client.lookup(tokens) == 48
            assert client.lookup(tokens, lookup_id="q", pin=True) == 48
            assert engine.stats().pinned_chunks == 3
            client.unpin("q")
            assert engine.stats().pinned_chunks == 0
            engine.close()
            assert not Path(endpoint.removeprefix("ipc://")).exists()
            assert client.lookup(tokens) == 0
    finally:
        engine.close()


def stored_on_disk(
    tmp_path: Path,
) -> tuple[EngineConfig, list[int], list[torch.Tensor], torch.Tensor]:
    """An engine configuration with a disk tier that holds 3 chunks (its RAM tier empty
    once reopened): the config, tokens, KV caches and slots stored."""
    tokens = list(range(3 * CHUNK))
    config = EngineConfig(
        chunk_size=CHUNK, max_local_cpu_size=0.01, local_disk=str(tmp_path / "disk")
    )
    kv = LAYOUT.allocate_kv_caches(4, generator=torch.Generator().manual_seed(0))
    slots = torch.arange(len(tokens))
    with SyncCacheEngine.open(config, LAYOUT, model_name="promise") as engine:
        assert engine.store(tokens, kv_caches=kv, slot_mapping=slots) == 48
    return config, tokens, kv, slots


def test_a_promise_over_the_wire_is_pending_until_the_disk_hits_are_in_memory(
    socket_dir: Path, tmp_path: Path
) -> None:
    config, tokens, kv, slots = stored_on_disk(tmp_path)
    asked: list[int] = []

    def prefill_speed() -> float:
        asked.append(1)
        return 1e9  # recomputing is never faster: every hit is worth loading

    with SyncCacheEngine.open(config, LAYOUT, model_name="promise") as engine:
        engine.serve_lookups("promise", 0, str(socket_dir), prefill_speed=prefill_speed)
        with SyncLookupClient("promise", 1, socket_dir=str(socket_dir), timeout=5) as client:
            first = client.promise(tokens, lookup_id="q", computed_tokens=0)
            assert first.pending
            assert first.tokens == 0
            deadline = time.monotonic() + 10
            promise = first
            while promise.pending and time.monotonic() < deadline:
                promise = client.promise(tokens, lookup_id="q")  # the scheduler's next step
            assert (promise.tokens, promise.pending) == (48, False)
            assert engine.stats().pinned_chunks == 3
            assert asked  # the serving engine's prefill speed went with the promise
            target = [torch.zeros_like(t) for t in kv]
            mask = engine.retrieve(tokens, kv_caches=target, slot_mapping=slots, lookup_id="q")
            assert bool(mask.all())
            for loaded, stored in zip(target, kv, strict=True):  # blocks 0-2 hold the slots
                assert torch.equal(loaded[:, :3], stored[:, :3])
                assert not loaded[:, 3:].any()
            assert engine.stats().pinned_chunks == 0
            with pytest.raises(InvalidInputError, match="computed_tokens"):
                client.promise(tokens, lookup_id="q", computed_tokens=-1)


def test_a_promise_over_the_wire_that_may_wait_is_answered_once_its_reads_end(
    socket_dir: Path, tmp_path: Path
) -> None:
    """``wait`` crosses the lookup socket: the first ask waits for the disk reads."""
    config, tokens, _, _ = stored_on_disk(tmp_path)
    with SyncCacheEngine.open(config, LAYOUT, model_name="promise") as engine:
        engine.serve_lookups("promise", 0, str(socket_dir))
        with SyncLookupClient("promise", 1, socket_dir=str(socket_dir), timeout=10) as client:
            first = client.promise(tokens, lookup_id="q", wait=4.0)
            assert (first.tokens, first.pending) == (48, False)
            assert engine.stats().pinned_chunks == 3
            with pytest.raises(InvalidInputError, match="wait"):
                client.promise(tokens, lookup_id="q", wait=-1.0)
            client.unpin("q")
