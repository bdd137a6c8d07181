"""A sidecar under memory pressure answers within its client's deadline (a miss at worst),
serves a long load in parts, and a client whose sidecar dies ends the requests waiting on
it at once (misses, not timeouts).

Real ``lmcache-async serve`` processes (:class:`tests.rpc.chaos.SidecarProcess`).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Final

import anyio
import pytest
import torch
import zmq.asyncio

from lmcache_async import KVLayout, RemoteCacheEngine
from lmcache_async.rpc.client.link import Link
from lmcache_async.rpc.client.settings import DEFAULT_CLIENT_LIMITS, ClientSettings
from lmcache_async.rpc.protocol import MessageType, tokens_payload
from tests.rpc.chaos import SidecarProcess

CHUNK: Final = 16
LAYOUT: Final = KVLayout.vllm_flash_attn(
    num_layers=2, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.float16
)
MODEL: Final = "sidecar-streams"
FLAGS: Final = ["--chunk-size", str(CHUNK), "--max-local-cpu-size", "0.02"]
PART_CHUNKS: Final = 2
LIMIT: Final = 120.0  # a test's bound: the sidecar's start (torch imports) dominates


def prompt(length: int, salt: int) -> list[int]:
    return [(i * 7919 + 13 + salt) % 50_000 for i in range(length)]


def kv_for(num_tokens: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-num_tokens // 16)
    return LAYOUT.allocate_kv_caches(blocks, generator=generator), torch.arange(num_tokens)


def payload_of(kv_caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    out = torch.empty(LAYOUT.payload_shape(len(slots)), dtype=LAYOUT.dtype)
    LAYOUT.gather(kv_caches, slots, out)
    return out


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="lmc-st-", dir="/tmp"))  # ipc paths are short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_sidecar(short_dir: Path, tmp_path: Path) -> Iterator[Any]:
    started: list[SidecarProcess] = []

    def start(*extra: str) -> SidecarProcess:
        sidecar = SidecarProcess(
            f"ipc://{short_dir}/s{len(started)}.sock", [*FLAGS, *extra], tmp_path
        )
        sidecar.start()
        started.append(sidecar)
        return sidecar

    yield start
    for sidecar in started:
        sidecar.stop()


@contextlib.asynccontextmanager
async def pool_held(url: str, num_tokens: int, name: bytes = b"holder") -> AsyncIterator[int]:
    """A client that reserves a store of ``num_tokens`` and holds what it was lent (yields
    the chunks) until the block ends; then it aborts the store. One session holds at most
    half the pool: it takes three to fill it."""
    context = zmq.asyncio.Context()
    link = Link(context, url, name, None, DEFAULT_CLIENT_LIMITS)
    try:
        hello = ClientSettings(url=url, layout=LAYOUT, model_name=MODEL).hello()
        await link.request(MessageType.HELLO, hello, timeout=30)
        header = {"start": 0, "limit": num_tokens, "timeout": 60.0}
        payload = tokens_payload(prompt(num_tokens, 99 + len(name)))
        reply = await link.request(MessageType.STORE, header, [payload], timeout=30)
        yield len(reply.header["chunks"])
        abort = {"txn": reply.header["txn"], "abort": True}
        await link.request(MessageType.COMMIT, abort, timeout=30)
    finally:
        link.close()
        context.term()


async def state(engine: RemoteCacheEngine) -> dict[str, Any]:
    stats = await engine.stats()
    assert stats["engine"] is not None
    return {**stats["engine"], **stats["server"], "client": stats["client"]}


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_a_long_load_comes_in_parts_with_its_pins_held_to_the_last(
    start_sidecar: Any,
) -> None:
    sidecar = start_sidecar("--pipeline-batch-chunks", str(PART_CHUNKS))
    num_tokens = 7 * CHUNK + 5  # four parts: 2 + 2 + 2 + 2 chunks (the last one short)
    tokens = prompt(num_tokens, 1)
    kv, slots = kv_for(num_tokens, 3)
    with anyio.fail_after(LIMIT):
        await sidecar.wait_ready()
        async with RemoteCacheEngine.connect(sidecar.url, LAYOUT, model_name=MODEL) as engine:
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
            assert await engine.lookup(tokens, lookup_id="a", pin=True) == num_tokens
            before = await state(engine)
            assert before["pinned_chunks"] == 8 and before["session_lookup_ids"] == 1
            target = LAYOUT.allocate_kv_caches(8, random=False)
            # Tiers named: the RETRIEVE's way, not the copy from what the lookup lent.
            mask = await engine.retrieve(
                tokens,
                kv_caches=target,
                slot_mapping=slots,
                lookup_id="a",
                retrieve_locations=["cpu"],
            )
            after = await state(engine)
    assert bool(mask.all())
    assert torch.equal(payload_of(target, slots), payload_of(kv, slots))
    # Four RETRIEVE parts (and a STATS between), counted as one retrieve, every token once.
    assert after["client"]["requests"] - before["client"]["requests"] == 4 + 1
    assert after["retrieve_requests"] - before["retrieve_requests"] == 1
    assert after["retrieved_tokens"] - before["retrieved_tokens"] == num_tokens
    # The pins held until the last part, and went with it; nothing is left lent.
    assert after["pinned_chunks"] == after["active_lookup_ids"] == 0
    assert after["session_lookup_ids"] == after["transactions"] == 0


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_a_killed_sidecar_ends_the_requests_waiting_on_it_at_once(
    start_sidecar: Any,
) -> None:
    sidecar = start_sidecar("--heartbeat-interval", "60")  # no heartbeat finds it first
    tokens = prompt(4 * CHUNK, 2)
    kv, slots = kv_for(4 * CHUNK, 4)
    timeout = 60.0  # far longer than the test may take: a miss must not wait for it
    with anyio.fail_after(LIMIT):
        await sidecar.wait_ready()
        async with RemoteCacheEngine.connect(
            sidecar.url, LAYOUT, model_name=MODEL, timeout=timeout, reconnect_interval=0.2
        ) as engine:
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == 4 * CHUNK
            assert sidecar.process is not None
            sidecar.process.send_signal(signal.SIGSTOP)  # connected, but no reply comes
            hits: list[int] = []
            with anyio.fail_after(timeout / 2):
                async with anyio.create_task_group() as tg:

                    async def look() -> None:
                        hits.append(await engine.lookup(tokens))

                    tg.start_soon(look)
                    await anyio.wait_all_tasks_blocked()  # the lookup waits
                    await anyio.to_thread.run_sync(sidecar.kill)
            assert hits == [0]
            assert not engine.is_healthy()
            # A new sidecar on the same socket: the client says hello again by itself,
            # and its calls meanwhile are misses.
            sidecar.start()
            await engine.wait_connected()
            assert await engine.lookup(tokens) == 0  # a new, empty cache
            client = (await engine.stats())["client"]
    assert client["timeouts"] == 0 and client["reconnects"] == 1


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_a_full_pool_is_a_miss_before_the_client_gives_up(
    start_sidecar: Any, tmp_path: Path
) -> None:
    # The pool waits far longer than the client: the sidecar must answer within the
    # client's patience anyway.
    sidecar = start_sidecar(
        "--local-disk",
        str(tmp_path / "disk"),
        "--wait-for-slow-tiers",
        "true",
        "--allocation-timeout",
        "60",
    )
    num_tokens = 8 * CHUNK
    tokens = prompt(num_tokens, 5)
    kv, slots = kv_for(num_tokens, 6)
    target = LAYOUT.allocate_kv_caches(8, random=False)
    pool_tokens = int(0.02 * (1 << 30)) // LAYOUT.token_bytes  # more than the pool holds
    with anyio.fail_after(LIMIT):
        await sidecar.wait_ready()
        async with RemoteCacheEngine.connect(
            sidecar.url, LAYOUT, model_name=MODEL, timeout=2.0
        ) as engine:
            assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
            async with (
                pool_held(sidecar.url, pool_tokens) as held,
                pool_held(sidecar.url, pool_tokens, b"second-holder") as second,
                pool_held(sidecar.url, pool_tokens, b"third-holder"),  # the odd page left
            ):
                full = await state(engine)
                # The holder took the whole pool, evicting the stored chunks (on disk now).
                assert full["pool"]["free_bytes"] < LAYOUT.token_bytes * CHUNK
                assert full["cached_chunks"] == 0 and held > 0 and second > 0
                mask = await engine.retrieve(tokens, kv_caches=target, slot_mapping=slots)
                assert not mask.any()  # no room for the disk's chunks: a miss, in time
                assert (await state(engine))["client"]["timeouts"] == 0
            # The holder gave its memory back: the chunks come from disk now.
            assert (await state(engine))["transactions"] == 0
            mask = await engine.retrieve(tokens, kv_caches=target, slot_mapping=slots)
            client = (await state(engine))["client"]
    assert bool(mask.all())
    assert torch.equal(payload_of(target, slots), payload_of(kv, slots))
    assert client["timeouts"] == 0
