"""KV events over PUB/SUB: the wire form, the buffer's wake-up, publisher and subscriber
in one process (with an embedded engine as the source), a subscriber that never reads,
and ``lmcache-async events`` as a real process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.to_thread
import msgpack
import pytest
import torch
import zmq

from lmcache_async import CacheEngine, EngineConfig, KVLayout
from lmcache_async.errors import ConfigError, InvalidInputError, ProtocolError
from lmcache_async.events import EventBuffer, EventKind, KVEvent
from lmcache_async.keys.digests import DIGEST_SIZE
from lmcache_async.rpc.events import (
    EVENT_FORMAT_VERSION,
    EventPublisher,
    EventSubscriber,
    ReceivedEvent,
    decode_event,
    encode_event,
    engine_event_source,
    format_event,
)
from lmcache_async.tenancy.tenants import TAG_BYTES, tenant_tag

CHUNK = 16
TIMEOUT = 20
LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=2, num_kv_heads=2, head_size=8, block_size=CHUNK, dtype=torch.float16
)


UNNAMED_TAG = tenant_tag(None)


def stored(
    n: int, *, tokens: int = 3, parent: bytes | None = None, tag: bytes = UNNAMED_TAG
) -> KVEvent:
    """A stored event of the unnamed tenant's chunks (or of the tenant with ``tag``)."""
    return KVEvent(
        kind=EventKind.STORED,
        block_hashes=tuple(
            tag + bytes([n, i]) * ((DIGEST_SIZE - TAG_BYTES) // 2) for i in range(tokens)
        ),
        parent_block_hash=parent,
        token_ids=tuple(range(n, n + tokens * CHUNK)),
        block_size=CHUNK,
        medium="cpu",
        ts=1000.0 + n,
    )


class BufferSource:
    """An EventSource over a bare EventBuffer."""

    def __init__(self, buffer: EventBuffer) -> None:
        self.buffer = buffer

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


def test_an_event_round_trips_with_every_field() -> None:
    event = stored(7, parent=b"\xaa" * 16)
    frames = encode_event(event, 42)
    assert frames[0] == b"kv"
    fields = msgpack.unpackb(frames[1], raw=False)
    assert fields == {
        "v": EVENT_FORMAT_VERSION,
        "seq": 42,
        "kind": "stored",
        "block_hashes": list(event.block_hashes),
        "parent_block_hash": b"\xaa" * 16,
        "token_ids": list(range(7, 7 + 3 * CHUNK)),
        "block_size": CHUNK,
        "medium": "cpu",
        "ts": 1007.0,
    }
    received = decode_event(frames, topic=b"kv")
    assert received.seq == 42
    assert received.event == event
    assert received.event.ts == 1007.0


def test_a_removed_event_without_parent_or_tokens_round_trips() -> None:
    event = KVEvent(EventKind.REMOVED, (b"\x01" * 16,), None, (), CHUNK, "disk", ts=5.0)
    received = decode_event(encode_event(event, 0, topic=b"t"), topic=b"t")
    assert received == ReceivedEvent(0, event)
    assert received.event.kind is EventKind.REMOVED


def _frames(**changes: object) -> list[bytes]:
    fields = msgpack.unpackb(encode_event(stored(1), 3)[1], raw=False)
    fields.update(changes)
    return [b"kv", msgpack.packb(fields, use_bin_type=True)]


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"kv"], "2 frames"),
        ([b"kv", b"\xc1"], "not valid msgpack"),
        ([b"kv", msgpack.packb([1, 2])], "must be a msgpack map"),
        ([b"kv", msgpack.packb(msgpack.ExtType(5, b"x"))], "extension type"),
        (_frames(v=2), "version 2"),
        (_frames(kind="moved"), "unknown event kind"),
        (_frames(seq=-1), "out of range"),
        (_frames(seq=True), "'seq'"),
        (_frames(block_size=0), "out of range"),
        (_frames(block_hashes=["ab"]), "list of bytes"),
        (_frames(parent_block_hash=3), "parent_block_hash"),
        (_frames(token_ids=[1, "2"]), "list of ints"),
        (_frames(ts=float("nan")), "finite"),
        (_frames(medium=None), "'medium'"),
    ],
)
def test_malformed_events_are_refused(frames: list[bytes], reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        decode_event(frames)


def test_another_topic_and_a_bad_seq_are_refused() -> None:
    with pytest.raises(ProtocolError, match="topic"):
        decode_event(encode_event(stored(1), 0), topic=b"other")
    with pytest.raises(InvalidInputError, match="seq"):
        encode_event(stored(1), -1)


def test_format_event_as_json_and_text() -> None:
    received = ReceivedEvent(9, stored(2, tokens=2, parent=b"\x0f" * 16, tag=b""))
    line = format_event(received, as_json=True)
    assert "\n" not in line
    assert json.loads(line) == {
        "seq": 9,
        "kind": "stored",
        "block_hashes": [(bytes([2, 0]) * 8).hex(), (bytes([2, 1]) * 8).hex()],
        "parent_block_hash": "0f" * 16,
        "token_ids": list(range(2, 2 + 2 * CHUNK)),
        "block_size": CHUNK,
        "medium": "cpu",
        "ts": 1002.0,
    }
    text = format_event(received)
    assert text.split() == [
        "9",
        "stored",
        "cpu",
        "blocks=2",
        f"block_size={CHUNK}",
        f"tokens={2 * CHUNK}",
        "parent=0f0f0f0f0f0f",
        "hashes=020002000200..020102010201",
    ]


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


# -- publisher and subscriber -----------------------------------------------------------------


@pytest.mark.anyio
async def test_published_events_reach_a_subscriber_in_order(short_dir: Path) -> None:
    url = f"ipc://{short_dir}/ev.sock"
    buffer = EventBuffer(100)
    events = [stored(i) for i in range(5)]
    with anyio.fail_after(TIMEOUT):
        with EventPublisher(url) as publisher, EventSubscriber(url) as subscriber:
            assert publisher.subscribers == 0
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.run, BufferSource(buffer))
                await publisher.wait_subscribed()
                assert publisher.subscribers == 1
                buffer.extend(events[:2])
                got = [await subscriber.receive() for _ in range(2)]
                buffer.extend(events[2:])
                got += [await subscriber.receive() for _ in range(3)]
                tg.cancel_scope.cancel()
            assert publisher.info() == {
                "endpoint": url,
                "topic": "kv",
                "published": 5,
                "withheld": 0,
                "subscribers": 1,
            }
    assert [r.seq for r in got] == [0, 1, 2, 3, 4]
    assert [r.event for r in got] == events
    assert subscriber.missed == 0
    assert not await anyio.Path(url.removeprefix("ipc://")).exists()


@pytest.mark.anyio
@pytest.mark.parametrize("tenant_events", [False, True])
async def test_a_named_tenants_events_are_published_only_when_asked(
    short_dir: Path, tenant_events: bool
) -> None:
    """By default a subscriber learns nothing of a named tenant: its events (tokens and
    digests) are withheld and counted; ``tenant_events`` publishes them."""
    url = f"ipc://{short_dir}/named.sock"
    buffer = EventBuffer(100)
    secret = stored(1, tag=tenant_tag("a-secret-salt"))
    public = stored(2)
    with anyio.fail_after(TIMEOUT):
        with (
            EventPublisher(url, tenant_events=tenant_events) as publisher,
            EventSubscriber(url) as subscriber,
        ):
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.run, BufferSource(buffer))
                await publisher.wait_subscribed()
                buffer.extend([secret, public])
                got = [await subscriber.receive()]
                if tenant_events:
                    got.append(await subscriber.receive())
                tg.cancel_scope.cancel()
    assert [r.event for r in got] == ([secret, public] if tenant_events else [public])
    assert publisher.info()["withheld"] == (0 if tenant_events else 1)


@pytest.mark.anyio
async def test_subscriber_skips_garbage_and_counts_gaps(short_dir: Path) -> None:
    url = f"ipc://{short_dir}/raw.sock"
    with anyio.fail_after(TIMEOUT):
        with EventPublisher(url) as publisher, EventSubscriber(url) as subscriber:
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.watch_subscriptions)
                await publisher.wait_subscribed()
                raw = publisher._socket
                await raw.send_multipart([b"kv", b"\xc1garbage"])
                await raw.send_multipart(encode_event(stored(1), 0))
                await raw.send_multipart(encode_event(stored(2), 4))  # 1..3 lost
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
    big = [stored(i % 200, tokens=64) for i in range(total)]  # ~4 KiB of token ids each
    with anyio.fail_after(TIMEOUT):
        with EventPublisher(url, sndhwm=16) as publisher, EventSubscriber(url) as subscriber:
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.watch_subscriptions)
                await publisher.wait_subscribed()
                # Nobody reads: every send must still return at once.
                assert await publisher.publish(big) == total
                tg.cancel_scope.cancel()
            # Drain what the queues kept. Once drained, a marker published after the burst
            # gets through; its sequence number shows how many were dropped, wherever the
            # drops fell (mid-burst or the whole tail).
            received: list[ReceivedEvent] = []
            while not received or received[-1].seq < total:
                with anyio.move_on_after(0.2):
                    while True:
                        received.append(await subscriber.receive())
                await publisher.publish([stored(0)])
    assert publisher.published > total
    burst = [r for r in received if r.seq < total]
    assert 0 < len(burst) < total  # the queue kept what fit and dropped the rest
    assert [r.seq for r in burst] == sorted({r.seq for r in burst})  # in order, no repeats
    assert subscriber.missed == received[-1].seq + 1 - len(received)
    assert subscriber.missed >= total - len(burst)


@pytest.mark.anyio
async def test_an_engine_announces_stores_and_clears(short_dir: Path) -> None:
    url = f"ipc://{short_dir}/engine.sock"
    tokens = [(i * 7919 + 3) % 30_000 for i in range(3 * CHUNK)]
    kv = LAYOUT.allocate_kv_caches(3, generator=torch.Generator().manual_seed(1))
    slots = torch.arange(len(tokens))
    config = EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.01)
    with anyio.fail_after(TIMEOUT):
        async with CacheEngine.open(config, LAYOUT, model_name="events") as engine:
            with EventPublisher(url) as publisher, EventSubscriber(url) as subscriber:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(publisher.run, engine_event_source(engine))
                    await publisher.wait_subscribed()
                    assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == 48
                    put = [await subscriber.receive()]
                    while sum(len(r.event.block_hashes) for r in put) < 3:
                        put.append(await subscriber.receive())
                    assert await engine.clear() == 3
                    removed = await subscriber.receive()
                    tg.cancel_scope.cancel()
    hashes = [h for r in put for h in r.event.block_hashes]
    assert all(r.event.kind is EventKind.STORED and r.event.medium == "cpu" for r in put)
    assert [t for r in put for t in r.event.token_ids] == tokens
    assert put[0].event.parent_block_hash is None
    assert len(set(hashes)) == 3 and all(len(h) >= 8 for h in hashes)
    assert removed.event.kind is EventKind.REMOVED
    assert set(removed.event.block_hashes) == set(hashes)
    assert removed.event.token_ids == ()
    assert [r.seq for r in [*put, removed]] == list(range(len(put) + 1))


def test_publisher_settings_are_checked(short_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"events: .*beyond loopback"):
        EventPublisher("tcp://0.0.0.0:5999")
    with pytest.raises(ConfigError, match="events"):
        EventPublisher("http://127.0.0.1:1")
    with pytest.raises(InvalidInputError, match="topic"):
        EventPublisher(f"ipc://{short_dir}/t.sock", topic=b"")
    with pytest.raises(InvalidInputError, match="sndhwm"):
        EventPublisher(f"ipc://{short_dir}/t.sock", sndhwm=0)
    with EventPublisher("tcp://127.0.0.1:0") as publisher:
        assert publisher.endpoint.startswith("tcp://127.0.0.1:")
        assert not publisher.endpoint.endswith(":0")
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
    gone = UNNAMED_TAG + b"\x02" * (DIGEST_SIZE - TAG_BYTES)
    events = [stored(1), KVEvent(EventKind.REMOVED, (gone,), None, (), CHUNK, "cpu")]
    with anyio.fail_after(60), EventPublisher(url) as publisher:
        process = await anyio.open_process(
            _events_command("--connect", url, "--json", "--count", "2")
        )
        async with process, anyio.create_task_group() as tg:
            tg.start_soon(publisher.watch_subscriptions)
            await publisher.wait_subscribed()
            await publisher.publish(events)
            assert process.stdout is not None
            output = b""
            async for chunk in process.stdout:
                output += chunk
            assert await process.wait() == 0
            tg.cancel_scope.cancel()
    lines = [json.loads(line) for line in output.decode().splitlines()]
    assert [line["seq"] for line in lines] == [0, 1]
    assert lines[0]["token_ids"] == list(events[0].token_ids)
    assert lines[0]["block_hashes"] == [h.hex() for h in events[0].block_hashes]
    assert lines[1]["kind"] == "removed" and lines[1]["block_hashes"] == [gone.hex()]


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
        assert [xpub.recv(), xpub.recv()] == [b"\x01kv", b"\x01kv"]
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
