"""The same-host stream: framed messages over a Unix stream socket read from the event
loop's callbacks, and the sidecar's router of identities. Real sockets; every wait is
bounded."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import struct
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import zmq

from lmcache_async.rpc.stream import (
    StreamRouter,
    StreamSocket,
    bind_stream,
    connect_stream,
    stream_path,
)
from lmcache_async.rpc.stream.router import IDENTITY_PREFIX
from lmcache_async.rpc.stream.socket import encode_message

pytestmark = pytest.mark.anyio

WAIT = 5.0
MAX_FRAME = 4 << 20


class Inbox:
    """Collects delivered messages (as bytes) and closings; lets a test wait for them."""

    def __init__(self) -> None:
        self.messages: list[list[bytes]] = []
        self.closings = 0
        self._changed = asyncio.Event()

    def __call__(self, frames: list[bytes | memoryview]) -> None:
        self.messages.append([bytes(frame) for frame in frames])
        self._changed.set()

    def closed(self) -> None:
        self.closings += 1
        self._changed.set()

    async def wait_until(self, done: Callable[[], bool]) -> None:
        with anyio.fail_after(WAIT):
            while not done():
                self._changed.clear()
                await self._changed.wait()


def stream(sock: socket.socket, inbox: Inbox, *, max_frame: int = MAX_FRAME) -> StreamSocket:
    return StreamSocket(sock, inbox, max_frame_bytes=max_frame, on_closed=inbox.closed)


def wire(frames: list[bytes]) -> bytes:
    pieces, _ = encode_message(frames)
    return b"".join(bytes(piece) for piece in pieces)


async def read_all(sock: socket.socket, count: int) -> bytes:
    """``count`` bytes from a non-blocking plain socket, waiting for each as it comes (fewer
    when the other end closes)."""
    data = bytearray()
    with anyio.fail_after(WAIT):
        while len(data) < count:
            await anyio.wait_readable(sock)
            try:
                piece = sock.recv(count - len(data))
            except ConnectionResetError:  # closed with bytes of ours unread
                break
            if not piece:
                break
            data += piece
    return bytes(data)


MESSAGES = [
    [b"x"],
    [b"", b"header", b""],
    [bytes([i % 251 for i in range(5000)]), b"\x00" * 3],
    # Over the 256 KiB receive buffer: gathered on its own.
    [b"big", os.urandom(300 << 10), os.urandom(700 << 10)],
    # More pieces than one sendmsg takes.
    [bytes([i % 256]) * (i % 5) for i in range(2500)],
]


async def test_messages_arrive_whole_exact_and_in_order() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sent_to, got = Inbox(), Inbox()
    a, b = stream(left, sent_to), stream(right, got)
    try:
        for message in MESSAGES:
            assert a.send_nowait(message)
        await got.wait_until(lambda: len(got.messages) == len(MESSAGES))
        assert got.messages == MESSAGES
        # And back the other way, through the async send.
        for message in reversed(MESSAGES):
            await b.send(message)
        await sent_to.wait_until(lambda: len(sent_to.messages) == len(MESSAGES))
        assert sent_to.messages == MESSAGES[::-1]
    finally:
        a.close()
        b.close()
    assert not got.closings and not sent_to.closings  # a close of our own is not told


async def test_a_message_split_at_every_byte_reads_the_same() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left.setblocking(False)
    got = Inbox()
    b = stream(right, got)
    messages = [[b"one", b"two" * 40], [b"", b"three"]]
    data = b"".join(wire(message) for message in messages)
    try:
        for index in range(len(data)):
            left.send(data[index : index + 1])
            await anyio.wait_all_tasks_blocked()
        await got.wait_until(lambda: len(got.messages) == 2)
        assert got.messages == messages
    finally:
        b.close()
        left.close()


BROKEN = {
    "no frame": struct.pack("<IH", 0, 0),
    "lengths past the message": struct.pack("<IHI", 4, 1, 10),
    "lengths short of the message": struct.pack("<IHI", 9, 1, 1) + b"abcde",
    "a frame over the limit": struct.pack("<IHI", 4 + 2048, 1, 2048) + b"z" * 2048,
}


@pytest.mark.parametrize("data", BROKEN.values(), ids=BROKEN.keys())
async def test_a_peer_that_breaks_the_framing_is_disconnected(data: bytes) -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left.setblocking(False)
    got = Inbox()
    b = stream(right, got, max_frame=1024)
    try:
        left.sendall(data)
        await got.wait_until(lambda: got.closings == 1)
        assert got.messages == [] and b.closed
        assert await read_all(left, 1) == b""  # the peer sees the end
        with pytest.raises(zmq.ZMQError):
            b.send_nowait([b"late"])
    finally:
        left.close()


async def test_a_peer_that_closes_is_told_once_and_sends_then_fail() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    got = Inbox()
    b = stream(right, got)
    left.close()
    await got.wait_until(lambda: got.closings == 1)
    with pytest.raises(zmq.ZMQError):
        await b.send([b"after"])
    await anyio.wait_all_tasks_blocked()
    assert got.closings == 1


async def test_a_peer_that_does_not_read_holds_back_new_messages_then_takes_them() -> None:
    """Unsent bytes are bounded: past the high-water mark a new message waits for room,
    and every byte arrives once the peer reads."""
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    right.setblocking(False)
    a = stream(left, Inbox())
    message = [b"m", os.urandom(1 << 20)]
    queued = 0
    try:
        while a.send_nowait(message):
            queued += 1
            assert queued < 64, "never refused: unsent bytes are not bounded"
        assert a.unsent_bytes >= 16 << 20
        waiting = asyncio.ensure_future(a.send(message))
        await anyio.wait_all_tasks_blocked()
        assert not waiting.done()
        expected = wire(message) * (queued + 1)
        assert await read_all(right, len(expected)) == expected
        with anyio.fail_after(WAIT):
            await waiting
        assert a.unsent_bytes == 0
    finally:
        a.close()
        right.close()


# -- the router ----------------------------------------------------------------------------


async def test_the_router_gives_each_connection_an_identity_and_routes_replies(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "r.sock.stream")
    listener = bind_stream(path)
    got, gone = Inbox(), Inbox()
    router = StreamRouter(listener, got, max_frame_bytes=MAX_FRAME, on_gone=lambda who: gone([who]))
    first, second = Inbox(), Inbox()
    clients = [stream(connect_stream(path), first), stream(connect_stream(path), second)]
    try:
        clients[0].send_nowait([b"from first"])
        clients[1].send_nowait([b"from second", b"2"])
        await got.wait_until(lambda: len(got.messages) == 2)
        by_body = {tuple(message[1:]): message[0] for message in got.messages}
        one, two = by_body[(b"from first",)], by_body[(b"from second", b"2")]
        for identity in (one, two):
            assert identity.startswith(IDENTITY_PREFIX) and len(identity) == 10
        assert one != two and router.peers == 2
        assert router.send_nowait([two, b"to second"])
        assert router.send_nowait([one, b"to first"])
        # Another identity is nobody's here: dropped, as a ROUTER drops it.
        assert router.send_nowait([IDENTITY_PREFIX + b"\xff" * 8, b"lost"])
        await first.wait_until(lambda: len(first.messages) == 1)
        await second.wait_until(lambda: len(second.messages) == 1)
        assert first.messages == [[b"to first"]] and second.messages == [[b"to second"]]
        clients[0].close()
        await gone.wait_until(lambda: len(gone.messages) == 1)
        assert gone.messages == [[one]] and router.peers == 1
    finally:
        for client in clients:
            client.close()
        router.detach()
        listener.close()
    assert router.peers == 0


async def test_the_router_closes_a_connection_of_another_user_unread(tmp_path: Path) -> None:
    """The socket file is the owner's only, and a peer of another user (root included)
    that connects anyway gets nothing: its connection is closed on accept, unread."""
    path = str(tmp_path / "o.sock.stream")
    listener = bind_stream(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    got = Inbox()
    # The sidecar's user is another one here: this process plays the intruder.
    router = StreamRouter(listener, got, max_frame_bytes=MAX_FRAME, uid=os.getuid() + 1)
    intruder = connect_stream(path)
    try:
        intruder.sendall(wire([b"\x01", b"hello"]))
        assert await read_all(intruder, 1) == b""
        assert got.messages == [] and router.peers == 0
    finally:
        intruder.close()
        router.detach()
        listener.close()


def test_where_the_stream_socket_lives(tmp_path: Path) -> None:
    assert stream_path("ipc:///tmp/a.sock") == "/tmp/a.sock.stream"
    assert stream_path("tcp://127.0.0.1:5555") is None
    assert stream_path("ipc:///" + "d" * 100) is None  # too long for a Unix socket
    path = tmp_path / "stale.stream"
    path.write_bytes(b"left by a sidecar that died")
    listener = bind_stream(str(path))  # replaced, as ZeroMQ replaces an ipc file
    try:
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    finally:
        listener.close()
    with pytest.raises(OSError):
        connect_stream(str(tmp_path / "nobody.stream"))
