"""LoopSocket: a ZeroMQ socket read from the event loop's reader callback. Real sockets
over ipc; every wait is bounded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
import zmq

from lmcache_async.rpc.transport import LoopSocket

pytestmark = pytest.mark.anyio

WAIT = 5.0


class Inbox:
    """Collects the messages a LoopSocket delivers; lets a test wait for a count."""

    def __init__(self) -> None:
        self.messages: list[list[bytes]] = []
        self._changed = asyncio.Event()

    def __call__(self, frames: list[zmq.Frame]) -> None:
        self.messages.append([frame.bytes for frame in frames])
        self._changed.set()

    async def wait_for(self, count: int) -> None:
        with anyio.fail_after(WAIT):
            while len(self.messages) < count:
                self._changed.clear()
                await self._changed.wait()


@asynccontextmanager
async def pair(
    tmp_path: Path, *, hwm: int = 1000
) -> AsyncIterator[tuple[zmq.Context[zmq.Socket[bytes]], str, zmq.Socket[bytes]]]:
    """A context, an ipc URL and a plain DEALER bound there (the peer of the test)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    url = f"ipc://{tmp_path / 'loop.sock'}"
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RCVHWM, hwm)
    peer.bind(url)
    try:
        yield context, url, peer
    finally:
        peer.close(linger=0)
        context.term()


def connected(
    context: zmq.Context[zmq.Socket[bytes]], url: str, inbox: Inbox, *, hwm: int = 1000
) -> LoopSocket:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, hwm)
    socket.connect(url)
    return LoopSocket(socket, inbox)


async def peer_receive(peer: zmq.Socket[bytes]) -> list[bytes]:
    with anyio.fail_after(WAIT):
        while True:
            try:
                return peer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                await anyio.sleep(0.001)


async def test_messages_arrive_whole_and_in_order(tmp_path: Path) -> None:
    async with pair(tmp_path) as (context, url, peer):
        inbox = Inbox()
        loop_socket = connected(context, url, inbox)
        try:
            for i in range(50):
                peer.send_multipart([b"m", str(i).encode(), b"x" * i])
            await inbox.wait_for(50)
            assert inbox.messages == [[b"m", str(i).encode(), b"x" * i] for i in range(50)]
        finally:
            loop_socket.close()


async def test_replies_that_arrive_while_sending_are_delivered(tmp_path: Path) -> None:
    """The descriptor is edge-triggered and a send can consume its edge: a reply that came
    in just before a send must still be delivered without any further traffic."""
    async with pair(tmp_path) as (context, url, peer):
        inbox = Inbox()
        loop_socket = connected(context, url, inbox)
        try:
            for i in range(200):
                assert loop_socket.send_nowait([b"ping", str(i).encode()])
                request = await peer_receive(peer)
                peer.send_multipart([b"pong", request[1]])
                # Send again before the loop got to read the pong.
                assert loop_socket.send_nowait([b"extra", str(i).encode()])
                await inbox.wait_for(i + 1)
                assert await peer_receive(peer) == [b"extra", str(i).encode()]
            assert inbox.messages == [[b"pong", str(i).encode()] for i in range(200)]
        finally:
            loop_socket.close()


async def test_replies_sent_from_the_reader_callback_leave_no_message_behind(
    tmp_path: Path,
) -> None:
    """A handler that answers in the reader callback: its sends hand the loop no drain
    (the callback reads the socket's state after each message), and every message of a
    burst, including those that arrive while it answers, is read and answered."""
    async with pair(tmp_path) as (context, url, peer):
        inbox = Inbox()
        drains: list[bool] = []
        holder: list[LoopSocket] = []

        def answer(frames: list[zmq.Frame]) -> None:
            inbox(frames)
            assert holder[0].send_nowait([b"re", frames[0].bytes])
            drains.append(holder[0]._drain_scheduled)

        holder.append(connected(context, url, answer))  # type: ignore[arg-type]
        loop_socket = holder[0]
        try:
            for burst in range(20):
                sent = [str(burst * 10 + i).encode() for i in range(burst % 7 + 1)]
                for body in sent:
                    peer.send_multipart([body])
                for body in sent:
                    assert await peer_receive(peer) == [b"re", body]
            await inbox.wait_for(sum(burst % 7 + 1 for burst in range(20)))
            assert drains and not any(drains)
            assert not loop_socket._reading
        finally:
            loop_socket.close()


async def test_a_wake_with_no_message_delivers_nothing(tmp_path: Path) -> None:
    """The reader receives before asking the socket's state: a wake-up with nothing to
    read (the descriptor also signals other changes) is answered by ZeroMQ's EAGAIN."""
    async with pair(tmp_path) as (context, url, peer):
        inbox = Inbox()
        loop_socket = connected(context, url, inbox)
        try:
            for _ in range(3):
                loop_socket._on_readable()
            assert inbox.messages == [] and not loop_socket._reading
            peer.send_multipart([b"later"])
            await inbox.wait_for(1)
            assert inbox.messages == [[b"later"]]
        finally:
            loop_socket.close()


async def test_a_message_that_comes_after_an_empty_receive_is_taken(tmp_path: Path) -> None:
    """A receive that finds nothing, then a message before the socket's state is read:
    reading the state spends the descriptor's edge, so the reader must take the message
    then, or it would wait for the next one."""
    async with pair(tmp_path) as (context, url, peer):
        inbox = Inbox()
        loop_socket = connected(context, url, inbox)
        try:
            loop_socket.pause()
            peer.send_multipart([b"raced"])
            # Here (a bounded wait, blocking: the loop must not read it), and the edges it
            # raised spent by the poll.
            assert loop_socket.socket.poll(int(WAIT * 1000), zmq.POLLIN)
            loop_socket._paused = False  # as resume(), without its drain
            receive = loop_socket._receive
            calls: list[int] = []

            def empty_first() -> list[zmq.Frame]:
                calls.append(1)
                if len(calls) == 1:
                    raise zmq.Again()  # as if the message came just after this receive
                return receive()

            loop_socket._receive = empty_first  # type: ignore[method-assign]
            loop_socket._on_readable()
            assert inbox.messages == [[b"raced"]] and len(calls) == 2
        finally:
            loop_socket.close()


async def test_a_handler_that_raises_strands_no_message(tmp_path: Path) -> None:
    async with pair(tmp_path) as (context, url, peer):
        inbox = Inbox()
        failed: list[bytes] = []

        def handler(frames: list[zmq.Frame]) -> None:
            if frames[0].bytes == b"bad" and not failed:
                failed.append(frames[0].bytes)
                raise RuntimeError("handler failed")
            inbox(frames)

        loop = asyncio.get_running_loop()
        errors: list[BaseException] = []
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx["exception"]))
        loop_socket = connected(context, url, handler)  # type: ignore[arg-type]
        try:
            peer.send_multipart([b"bad"])
            peer.send_multipart([b"after"])  # queued behind the message that fails
            await inbox.wait_for(1)
            assert inbox.messages == [[b"after"]]
            assert failed == [b"bad"] and [str(e) for e in errors] == ["handler failed"]
        finally:
            loop.set_exception_handler(None)
            loop_socket.close()


async def test_pause_holds_messages_until_resume(tmp_path: Path) -> None:
    async with pair(tmp_path) as (context, url, peer):
        inbox = Inbox()
        loop_socket = connected(context, url, inbox)
        try:
            peer.send_multipart([b"first"])
            await inbox.wait_for(1)
            loop_socket.pause()
            for i in range(5):
                peer.send_multipart([str(i).encode()])
            # A round trip through the peer proves the five reached this end's queue.
            assert loop_socket.send_nowait([b"probe"])
            assert await peer_receive(peer) == [b"probe"]
            for _ in range(20):
                await anyio.lowlevel.checkpoint()
            assert inbox.messages == [[b"first"]]
            loop_socket.resume()
            await inbox.wait_for(6)
            assert inbox.messages[1:] == [[str(i).encode()] for i in range(5)]
        finally:
            loop_socket.close()


async def test_send_waits_until_the_socket_can_take_the_message(tmp_path: Path) -> None:
    """On an IMMEDIATE socket with no peer yet, send_nowait refuses and send() waits (the
    caller bounds the wait); once a peer binds, the waiting send completes by itself."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    url = f"ipc://{tmp_path / 'later.sock'}"
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.IMMEDIATE, 1)
    socket.setsockopt(zmq.RECONNECT_IVL, 10)
    socket.connect(url)
    loop_socket = LoopSocket(socket, Inbox())
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    try:
        assert not loop_socket.send_nowait([b"early"])
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.2):
                await loop_socket.send([b"early"])
        async with anyio.create_task_group() as tg:
            tg.start_soon(loop_socket.send, [b"waited"])
            await anyio.lowlevel.checkpoint()
            peer.bind(url)
            assert await peer_receive(peer) == [b"waited"]
        assert loop_socket.send_nowait([b"after"])
        # No sender waits now: a send no longer hands the loop a drain (a pass per send).
        assert loop_socket._writable is None and not loop_socket._drain_scheduled
        assert await peer_receive(peer) == [b"after"]
    finally:
        loop_socket.close()
        peer.close(linger=0)
        context.term()


async def test_closed_socket_neither_delivers_nor_sends(tmp_path: Path) -> None:
    async with pair(tmp_path) as (context, url, peer):
        inbox = Inbox()
        loop_socket = connected(context, url, inbox)
        loop_socket.detach()
        loop_socket.detach()  # idempotent
        peer.send_multipart([b"late"])
        for _ in range(20):
            await anyio.sleep(0.005)
        assert inbox.messages == []
        with pytest.raises(zmq.ZMQError):
            loop_socket.send_nowait([b"x"])
        with pytest.raises(zmq.ZMQError):
            await loop_socket.send([b"x"])
        loop_socket.close()
        loop_socket.close()
        assert loop_socket.closed
