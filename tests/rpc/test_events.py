"""KV events over PUB/SUB in vLLM's wire format: the blocks of an engine's chunks, every
frame read by vLLM's own decoder, the buffer's wake-up, publisher and subscriber in one
process (with an embedded engine as the source), replays of missed batches, a subscriber
that never reads, and ``lmcache-async events`` as a real process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgpack
import pytest
import torch
import zmq

from lmcache_async import CacheEngine, EngineConfig, KVLayout
from lmcache_async.errors import ConfigError, InvalidInputError, ProtocolError
from lmcache_async.events import EventBuffer, EventKind, KVEvent, PendingEvent, event_bytes
from lmcache_async.keys.digests import DIGEST_SIZE
from lmcache_async.rpc.event_subscriber import EventSubscriber, ReceivedBatch, format_batch
from lmcache_async.rpc.events import EventPublisher, engine_event_source
from lmcache_async.rpc.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    block_hashes_of,
    decode_batch,
    encode_batch,
    wire_events,
)
from lmcache_async.tenancy.tenants import TAG_BYTES, tenant_tag

CHUNK = 32
BLOCK = 16
TIMEOUT = 20
LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=2, num_kv_heads=2, head_size=8, block_size=BLOCK, dtype=torch.float16
)
UNNAMED_TAG = tenant_tag(None)


def digest(n: int, i: int, tag: bytes = UNNAMED_TAG) -> bytes:
    return tag + bytes([n, i]) * ((DIGEST_SIZE - TAG_BYTES) // 2)


def stored(
    n: int, *, chunks: int = 3, parent: bytes | None = None, tag: bytes = UNNAMED_TAG
) -> KVEvent:
    """A stored event of ``chunks`` whole chunks of the unnamed tenant (or of ``tag``'s)."""
    return KVEvent(
        kind=EventKind.STORED,
        block_hashes=tuple(digest(n, i, tag) for i in range(chunks)),
        parent_block_hash=parent,
        token_ids=tuple(range(n, n + chunks * CHUNK)),
        block_size=CHUNK,
        medium="cpu",
        ts=1000.0 + n,
    )


class BufferSource:
    """An EventSource over a bare EventBuffer."""

    block_size = BLOCK
    chunk_size = CHUNK

    def __init__(self, buffer: EventBuffer) -> None:
        self.buffer = buffer

    @property
    def events_dropped(self) -> int:
        return self.buffer.dropped

    def take_events(self) -> list[KVEvent]:
        return self.buffer.take()

    async def wait_events(self) -> None:
        await self.buffer.wait()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory for ipc sockets (unix socket paths hold at most 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="lmc-ev-", dir="/tmp") as path:
        yield Path(path)


# -- the wire form ----------------------------------------------------------------------------


def test_chunks_become_chained_blocks_of_the_engine_block_size() -> None:
    parent = digest(9, 9)
    event = stored(1, parent=parent)
    block = wire_events(event, block_size=BLOCK, chunk_size=CHUNK)
    assert isinstance(block, BlockStored)
    per_chunk = CHUNK // BLOCK
    expected = [h for d in event.block_hashes for h in block_hashes_of(d, per_chunk)]
    assert block.block_hashes == tuple(expected) and len(expected) == 3 * per_chunk
    assert len(set(expected)) == len(expected)
    assert block.parent_block_hash == block_hashes_of(parent, per_chunk)[-1]
    assert block.token_ids == event.token_ids and block.block_size == BLOCK
    assert block.medium == "CPU"
    # A short last chunk: its whole blocks only.
    short = KVEvent(EventKind.STORED, (digest(2, 0),), None, tuple(range(20)), CHUNK, "disk")
    cut = wire_events(short, block_size=BLOCK, chunk_size=CHUNK)
    assert isinstance(cut, BlockStored)
    assert cut.token_ids == tuple(range(16)) and cut.medium == "DISK"
    # A removal names the very blocks the store did.
    gone = KVEvent(EventKind.REMOVED, event.block_hashes, None, (), CHUNK, "redis")
    assert wire_events(gone, block_size=BLOCK, chunk_size=CHUNK) == BlockRemoved(
        tuple(expected), "DISK"
    )
    cleared = KVEvent(EventKind.CLEARED, (), None, (), CHUNK, "*")
    assert wire_events(cleared, block_size=BLOCK, chunk_size=CHUNK) == AllBlocksCleared()
    with pytest.raises(InvalidInputError, match="multiple"):
        wire_events(event, block_size=24, chunk_size=CHUNK)


def test_every_batch_decodes_with_vllms_own_decoder() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec

    events = [
        wire_events(stored(1, parent=digest(8, 8)), block_size=BLOCK, chunk_size=CHUNK),
        wire_events(
            KVEvent(EventKind.REMOVED, (digest(1, 0),), None, (), CHUNK, "disk"),
            block_size=BLOCK,
            chunk_size=CHUNK,
        ),
        AllBlocksCleared(),
    ]
    payload = encode_batch([e for e in events if e is not None], 1234.5)
    batch = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(payload)
    assert batch.ts == 1234.5
    first, second, third = batch.events
    assert isinstance(first, kv_events.BlockStored)
    assert first.block_hashes == list(events[0].block_hashes)  # type: ignore[union-attr]
    assert first.parent_block_hash == events[0].parent_block_hash  # type: ignore[union-attr]
    assert first.token_ids == list(range(1, 1 + 3 * CHUNK))
    assert (first.block_size, first.medium, first.lora_id) == (BLOCK, "CPU", None)
    assert isinstance(second, kv_events.BlockRemoved) and second.medium == "DISK"
    assert isinstance(third, kv_events.AllBlocksCleared)
    # And ours reads what vLLM encodes.
    theirs = msgspec.msgpack.Encoder().encode(batch)
    ts, decoded = decode_batch(theirs)
    assert (ts, decoded) == (1234.5, [e for e in events if e is not None])


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb({"ts": 1}), "array"),
        (msgpack.packb([float("nan"), []]), "finite"),
        (msgpack.packb([1.0, [[1, 2]]]), "map"),
        (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": ["x"]}]]), "block_size"),
        (msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [-1]}]]), "u64"),
    ],
)
def test_malformed_batches_are_refused(payload: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        decode_batch(payload)


def test_unknown_event_types_are_skipped_and_lines_are_printable() -> None:
    payload = msgpack.packb([2.0, [{"type": "Mystery"}, {"type": "AllBlocksCleared"}]])
    assert decode_batch(payload) == (2.0, [AllBlocksCleared()])
    block = wire_events(stored(2, chunks=1), block_size=BLOCK, chunk_size=CHUNK)
    assert block is not None
    received = ReceivedBatch(9, 3.0, (block, AllBlocksCleared()))
    lines = [json.loads(line) for line in format_batch(received, as_json=True)]
    assert lines[0]["type"] == "BlockStored" and lines[0]["seq"] == 9
    assert lines[0]["token_ids"] == list(range(2, 2 + CHUNK))
    assert lines[1] == {"seq": 9, "ts": 3.0, "type": "AllBlocksCleared"}
    text = format_batch(received)
    assert text[0].split()[:4] == ["9", "BlockStored", "CPU", "blocks=2"]


# -- the buffer's wake-up ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_buffer_wait_wakes_on_add_and_returns_at_once_when_not_empty() -> None:
    buffer = EventBuffer(4)
    woke = anyio.Event()

    async def waiter() -> None:
        await buffer.wait()
        woke.set()

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            assert not woke.is_set()
            buffer.add(stored(1))
            await woke.wait()
        await buffer.wait()  # not empty: returns at once
        assert buffer.take() == [stored(1)]


@pytest.mark.anyio
async def test_a_disabled_buffer_never_wakes_its_waiter() -> None:
    buffer = EventBuffer(4, enabled=False)
    buffer.add(stored(1))
    with anyio.move_on_after(0.05) as scope:
        await buffer.wait()
    assert scope.cancelled_caught
    assert len(buffer) == 0


def test_the_buffer_is_bounded_in_bytes_and_drops_the_oldest() -> None:
    one = event_bytes(stored(0))
    buffer = EventBuffer(1000, max_bytes=3 * one)
    for n in range(5):
        buffer.add(stored(n))
    assert (len(buffer), buffer.dropped, buffer.nbytes) == (3, 2, 3 * one)
    assert buffer.take() == [stored(2), stored(3), stored(4)]
    assert (buffer.nbytes, buffer.dropped) == (0, 2)
    buffer.add(stored(9, chunks=40))  # larger than the bound alone: kept, the newest
    assert buffer.take() == [stored(9, chunks=40)]


def test_pending_events_count_the_bytes_they_hold() -> None:
    buffer = EventBuffer(1000, max_bytes=1000)
    late = stored(1)
    buffer.add(PendingEvent(lambda: late, 600))
    buffer.add(PendingEvent(lambda: stored(2), 600))
    assert (len(buffer), buffer.dropped, buffer.nbytes) == (1, 1, 600)
    assert buffer.take() == [stored(2)]


@pytest.mark.anyio
async def test_events_dropped_unread_leave_a_gap_in_the_sequence(short_dir: Path) -> None:
    """A source that dropped events before the publisher took them: the next batch's
    sequence number skips one, so the subscriber knows it missed something."""
    url = f"ipc://{short_dir}/gap.sock"
    buffer = EventBuffer(2)
    with anyio.fail_after(TIMEOUT):
        with EventPublisher(url) as publisher, EventSubscriber(url) as subscriber:
            async with anyio.create_task_group() as tg:
                await publish_running(publisher, buffer, tg)
                buffer.add(stored(0))
                first = await subscriber.receive()
                for n in range(1, 5):  # one task step: four events into a buffer of two
                    buffer.add(stored(n))
                second = await subscriber.receive()
                tg.cancel_scope.cancel()
            info = publisher.info()
    assert (first.seq, second.seq) == (0, 2)
    assert second.events == tuple(
        wire_events(stored(n), block_size=BLOCK, chunk_size=CHUNK) for n in (3, 4)
    )
    assert subscriber.missed == 1
    assert (info["lost"], info["next_seq"]) == (2, 3)


# -- publisher and subscriber -----------------------------------------------------------------


async def publish_running(publisher: EventPublisher, buffer: EventBuffer, group: Any) -> None:
    group.start_soon(publisher.run, BufferSource(buffer))
    await publisher.wait_subscribed()


@pytest.mark.anyio
async def test_published_batches_reach_a_subscriber_in_order(short_dir: Path) -> None:
    url = f"ipc://{short_dir}/ev.sock"
    buffer = EventBuffer(100)
    events = [stored(i) for i in range(5)]
    with anyio.fail_after(TIMEOUT):
        with EventPublisher(url) as publisher, EventSubscriber(url) as subscriber:
            assert publisher.subscribers == 0
            async with anyio.create_task_group() as tg:
                await publish_running(publisher, buffer, tg)
                assert publisher.subscribers == 1
                got = []
                for event in events:  # one wake-up each: one batch each
                    buffer.add(event)
                    got.append(await subscriber.receive())
                tg.cancel_scope.cancel()
            info = publisher.info()
    assert [b.seq for b in got] == [0, 1, 2, 3, 4]
    assert [b.events for b in got] == [
        (wire_events(e, block_size=BLOCK, chunk_size=CHUNK),) for e in events
    ]
    assert (info["published"], info["withheld"], info["next_seq"]) == (5, 0, 5)
    assert subscriber.missed == 0
    assert not await anyio.Path(url.removeprefix("ipc://")).exists()


@pytest.mark.anyio
@pytest.mark.parametrize("tenant_events", [False, True])
async def test_a_named_tenants_events_are_published_only_when_asked(
    short_dir: Path, tenant_events: bool
) -> None:
    """By default a subscriber learns nothing of a named tenant: its events (tokens and
    block hashes) are withheld and counted; ``tenant_events`` publishes them."""
    url = f"ipc://{short_dir}/named.sock"
    secret = stored(1, tag=tenant_tag("a-secret-salt"))
    public = stored(2)
    with anyio.fail_after(TIMEOUT):
        with (
            EventPublisher(url, tenant_events=tenant_events) as publisher,
            EventSubscriber(url) as subscriber,
        ):
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.watch_subscriptions)
                await publisher.wait_subscribed()
                await publisher.publish([secret, public], block_size=BLOCK, chunk_size=CHUNK)
                batch = await subscriber.receive()
                tg.cancel_scope.cancel()
    tokens = [e.token_ids for e in batch.events if isinstance(e, BlockStored)]
    expected = [secret.token_ids, public.token_ids] if tenant_events else [public.token_ids]
    assert tokens == expected
    assert publisher.info()["withheld"] == (0 if tenant_events else 1)


@pytest.mark.anyio
async def test_a_subscriber_gets_missed_batches_from_the_replay_socket(short_dir: Path) -> None:
    """Batches published before the subscriber joined, and a gap made by garbage in
    place of one batch, come from the replay socket: every batch once, in order."""
    url, replay = f"ipc://{short_dir}/pub.sock", f"ipc://{short_dir}/replay.sock"
    with anyio.fail_after(TIMEOUT):
        with EventPublisher(url, replay=replay) as publisher:
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.watch_subscriptions)
                for i in range(3):  # nobody listens yet
                    await publisher.publish([stored(i)], block_size=BLOCK, chunk_size=CHUNK)
                with EventSubscriber(url, replay=replay) as subscriber:
                    await publisher.wait_subscribed()
                    seq = await publisher.publish([stored(3)], block_size=BLOCK, chunk_size=CHUNK)
                    first = [await subscriber.receive() for _ in range(4)]
                    # A batch the subscriber never sees live: kept, not sent.
                    publisher._keep(4, encode_batch([], 1.0))
                    publisher._seq = 5
                    await publisher.publish([stored(5)], block_size=BLOCK, chunk_size=CHUNK)
                    rest = [await subscriber.receive() for _ in range(2)]
                tg.cancel_scope.cancel()
    assert seq == 3
    assert [b.seq for b in [*first, *rest]] == [0, 1, 2, 3, 4, 5]
    assert subscriber.missed == 0


@pytest.mark.anyio
async def test_the_replay_keeps_at_most_its_bytes(short_dir: Path) -> None:
    url, replay = f"ipc://{short_dir}/b.sock", f"ipc://{short_dir}/br.sock"
    with anyio.fail_after(TIMEOUT):
        with EventPublisher(url, replay=replay, replay_bytes=4096) as publisher:
            for i in range(50):
                await publisher.publish([stored(i % 200)], block_size=BLOCK, chunk_size=CHUNK)
            assert 0 < publisher.info()["kept_for_replay"] < 50
            assert sum(len(p) for _, p in publisher._kept) <= 4096
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.watch_subscriptions)
                with EventSubscriber(url, replay=replay) as subscriber:
                    await publisher.wait_subscribed()
                    await publisher.publish([stored(7)], block_size=BLOCK, chunk_size=CHUNK)
                    kept = [seq for seq, _ in publisher._kept if seq < 50]
                    got = [await subscriber.receive() for _ in range(len(kept) + 1)]
                tg.cancel_scope.cancel()
    assert [b.seq for b in got] == [*kept, 50]
    assert kept == list(range(50 - len(kept), 50))
    assert subscriber.missed == 50 - len(kept)  # what the replay no longer held


@pytest.mark.anyio
async def test_subscriber_skips_garbage_and_counts_gaps(short_dir: Path) -> None:
    url = f"ipc://{short_dir}/raw.sock"
    payload = encode_batch([AllBlocksCleared()], 1.0)
    with anyio.fail_after(TIMEOUT):
        with EventPublisher(url) as publisher, EventSubscriber(url) as subscriber:
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.watch_subscriptions)
                await publisher.wait_subscribed()
                raw = publisher._socket
                await raw.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1garbage"])
                await raw.send_multipart([b"", (0).to_bytes(8, "big"), payload])
                await raw.send_multipart([b"", (4).to_bytes(8, "big"), payload])  # 1..3 lost
                first = await subscriber.receive()
                second = await subscriber.receive()
                tg.cancel_scope.cancel()
    assert (first.seq, second.seq) == (0, 4)
    assert subscriber.skipped == 1
    assert subscriber.missed == 3


@pytest.mark.anyio
async def test_a_subscriber_that_never_reads_never_blocks_the_publisher(short_dir: Path) -> None:
    url = f"ipc://{short_dir}/slow.sock"
    total = 2000
    big = [stored(i % 200, chunks=4) for i in range(total)]
    with anyio.fail_after(TIMEOUT):
        with EventPublisher(url, sndhwm=16) as publisher, EventSubscriber(url) as subscriber:
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.watch_subscriptions)
                await publisher.wait_subscribed()
                for event in big:  # nobody reads: every send still returns at once
                    await publisher.publish([event], block_size=BLOCK, chunk_size=CHUNK)
                tg.cancel_scope.cancel()
            # Drain what the queue kept; a marker published after it gets through, and
            # its sequence number shows how many were dropped.
            received: list[ReceivedBatch] = []
            while not received or received[-1].seq < total:
                with anyio.move_on_after(0.2):
                    while True:
                        received.append(await subscriber.receive())
                await publisher.publish([stored(0)], block_size=BLOCK, chunk_size=CHUNK)
    burst = [r for r in received if r.seq < total]
    assert 0 < len(burst) < total  # the queue kept what fit and dropped the rest
    assert [r.seq for r in burst] == sorted({r.seq for r in burst})  # in order, no repeats
    assert subscriber.missed == received[-1].seq + 1 - len(received)


@pytest.mark.anyio
async def test_an_engine_announces_stores_and_clears(short_dir: Path) -> None:
    url = f"ipc://{short_dir}/engine.sock"
    tokens = [(i * 7919 + 3) % 30_000 for i in range(3 * CHUNK)]
    kv = LAYOUT.allocate_kv_caches(6, generator=torch.Generator().manual_seed(1))
    slots = torch.arange(len(tokens))
    config = EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01)
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(config, LAYOUT, model_name="events") as engine:
            with EventPublisher(url) as publisher, EventSubscriber(url) as subscriber:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(publisher.run, engine_event_source(engine))
                    await publisher.wait_subscribed()
                    assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == 96
                    put: list[Any] = []
                    while sum(len(e.block_hashes) for e in put) < 6:
                        put.extend((await subscriber.receive()).events)
                    assert await engine.clear() == 3
                    cleared = await subscriber.receive()
                    tg.cancel_scope.cancel()
    assert all(isinstance(e, BlockStored) and e.medium == "CPU" for e in put)
    assert [t for e in put for t in e.token_ids] == tokens
    assert put[0].parent_block_hash is None and put[0].block_size == BLOCK
    hashes = [h for e in put for h in e.block_hashes]
    assert len(set(hashes)) == 6
    assert cleared.events == (AllBlocksCleared(),)


def test_publisher_settings_are_checked(short_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"events: .*beyond loopback"):
        EventPublisher("tcp://0.0.0.0:5999")
    with pytest.raises(ConfigError, match="events_replay"):
        EventPublisher(f"ipc://{short_dir}/t.sock", replay="tcp://0.0.0.0:5998")
    with pytest.raises(ConfigError, match="events"):
        EventPublisher("http://127.0.0.1:1")
    with pytest.raises(InvalidInputError, match="topic"):
        EventPublisher(f"ipc://{short_dir}/t.sock", topic="kv")  # type: ignore[arg-type]
    for name in ("sndhwm", "replay_batches", "replay_bytes"):
        with pytest.raises(InvalidInputError, match=name):
            EventPublisher(f"ipc://{short_dir}/t.sock", **{name: 0})
    with EventPublisher("tcp://127.0.0.1:0", replay="tcp://127.0.0.1:0") as publisher:
        assert publisher.endpoint.startswith("tcp://127.0.0.1:")
        assert not publisher.endpoint.endswith(":0")
        assert publisher.replay_endpoint is not None
        assert not publisher.replay_endpoint.endswith(":0")
        with pytest.raises(ConfigError, match="cannot bind"):
            EventPublisher(publisher.endpoint)


# -- lmcache-async events ---------------------------------------------------------------------


def _events_command(*args: str) -> list[str]:
    script = Path(sys.executable).with_name("lmcache-async")
    base = [str(script)] if script.exists() else [sys.executable, "-m", "lmcache_async.cli"]
    return [*base, "events", *args]


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_events_command_prints_json_lines_and_stops_after_count(short_dir: Path) -> None:
    url = f"ipc://{short_dir}/cli.sock"
    gone = KVEvent(EventKind.REMOVED, (digest(2, 2),), None, (), CHUNK, "cpu")
    with anyio.fail_after(60), EventPublisher(url) as publisher:
        process = await anyio.open_process(
            _events_command("--connect", url, "--json", "--count", "2")
        )
        async with process, anyio.create_task_group() as tg:
            tg.start_soon(publisher.watch_subscriptions)
            await publisher.wait_subscribed()
            await publisher.publish([stored(1)], block_size=BLOCK, chunk_size=CHUNK)
            await publisher.publish([gone], block_size=BLOCK, chunk_size=CHUNK)
            assert process.stdout is not None
            output = b""
            async for chunk in process.stdout:
                output += chunk
            assert await process.wait() == 0
            tg.cancel_scope.cancel()
    lines = [json.loads(line) for line in output.decode().splitlines()]
    assert [line["seq"] for line in lines] == [0, 1]
    assert lines[0]["type"] == "BlockStored"
    assert lines[0]["token_ids"] == list(stored(1).token_ids)
    assert lines[1]["type"] == "BlockRemoved"
    assert lines[1]["block_hashes"] == block_hashes_of(digest(2, 2), CHUNK // BLOCK)


@pytest.mark.subprocess
def test_events_command_exits_cleanly_on_sigint_and_sigterm(short_dir: Path) -> None:
    url = f"ipc://{short_dir}/sig.sock"
    context = zmq.Context()
    xpub = context.socket(zmq.XPUB)  # learns when each command has subscribed
    xpub.setsockopt(zmq.LINGER, 0)
    xpub.setsockopt(zmq.XPUB_VERBOSE, 1)
    xpub.setsockopt(zmq.RCVTIMEO, 60_000)
    xpub.bind(url)
    processes = [
        subprocess.Popen(
            _events_command("--connect", url), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    results = []
    try:
        assert [xpub.recv(), xpub.recv()] == [b"\x01", b"\x01"]  # all topics
        for process, signum in zip(processes, (signal.SIGINT, signal.SIGTERM), strict=True):
            process.send_signal(signum)
        results = [process.communicate(timeout=30) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        xpub.close()
        context.term()
    for process, (out, err) in zip(processes, results, strict=True):
        assert process.returncode == 0, err.decode(errors="replace")
        assert out == b""
        assert b"Traceback" not in err
