"""One DEALER socket to the sidecar (or its same-host stream socket) and the session it
holds: requests with ids, their replies matched in the reader callback, one timer for all
their deadlines, and a monitor (the stream's end) that tells at once when the connection to
the sidecar drops (it died or restarted), so the requests waiting on it end then, not at
their deadline."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import anyio
import zmq
import zmq.asyncio

from lmcache_async.errors import ProtocolError
from lmcache_async.logging import get_logger
from lmcache_async.rpc.client.segment import Segment
from lmcache_async.rpc.client.welcome import Welcome
from lmcache_async.rpc.client.wire import Unavailable, raise_error
from lmcache_async.rpc.curve import CurveClientKeys
from lmcache_async.rpc.protocol import Message, MessageLimits, MessageType, decode, encode
from lmcache_async.rpc.stream import StreamSocket, connect_stream
from lmcache_async.rpc.transport import LoopSocket

__all__ = ["Link", "Sent"]

log = get_logger(__name__)

_RECONNECT_IVL_MS: Final = 100
_ZERO_COPY_BYTES: Final = 4 << 20
_EVENT_BYTES: Final = 6


@dataclass(eq=False, slots=True)
class Sent:
    """A request sent ahead of the wait for its reply (:meth:`Link.send_ahead`)."""

    msg_type: MessageType
    request_id: int
    future: asyncio.Future[Message | None]
    answered: bool = False
    """Its reply was taken (:meth:`Link.reply`) or given back."""


def _checked(msg_type: MessageType, reply: Message | None) -> Message:
    """``reply`` as the answer to a ``msg_type`` request.

    Raises:
        Unavailable: no reply (the link was closed), or an error reply saying so.
        InvalidInputError, ProtocolError: an error reply saying so, or a reply of
            another type.
    """
    if reply is None:
        raise Unavailable(f"{msg_type.name}: the link was closed")
    if reply.type is MessageType.ERROR:
        raise_error(msg_type, reply)
    if reply.type is not msg_type:
        raise ProtocolError(f"a {reply.type.name} reply to a {msg_type.name} request")
    return reply


class Link:
    """One DEALER socket and the session it holds with the server.

    Replies are read in the event loop's reader callback (:class:`LoopSocket`): each goes
    straight to the future of the request with its id; a reply nobody waits for (it came
    after its request timed out) is dropped, its transaction given back. ``welcome`` and
    ``segment`` are what the server's HELLO reply gave this link. ``on_disconnect`` is
    called (soon after, on the loop) when an established connection to the server drops.
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        url: str,
        identity: bytes,
        keys: CurveClientKeys | None,
        limits: MessageLimits,
        *,
        on_disconnect: Callable[[Link], None] | None = None,
        stream: str | None = None,
    ) -> None:
        self.identity = identity
        self.url = url
        self._limits = limits
        self._on_disconnect = on_disconnect
        self._monitor: LoopSocket | None = None
        self._ids = itertools.count(1)
        # A future resolves to the reply, or to None when the link is closed.
        self._pending: dict[int, asyncio.Future[Message | None]] = {}
        # Each waiting request's deadline, and one timer for the earliest of them: with
        # requests of one timeout it is armed once per timeout, not once per request.
        self._deadlines: dict[int, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        # Messages without reply deferred to the loop's next pass (notify_soon), each with
        # its deadline, sent before any later message; a task sends them when the socket
        # could not take them at once.
        self._later: collections.deque[tuple[list[bytes | memoryview], float]] = collections.deque()
        self._later_scheduled = False
        self._draining: asyncio.Task[None] | None = None
        self.dead = False
        self.welcome: Welcome | None = None
        self.segment: Segment | None = None
        self.stream = stream is not None
        """Whether this link is the same-host stream (:mod:`~lmcache_async.rpc.stream`)."""
        self._socket: LoopSocket | StreamSocket
        if stream is not None:
            self._socket = StreamSocket(
                connect_stream(stream),
                self._on_message,
                max_frame_bytes=limits.max_frame_bytes,
                on_closed=self._disconnected,
            )
        else:
            self._socket = self._zmq_socket(context, keys)

    def _zmq_socket(self, context: zmq.asyncio.Context, keys: CurveClientKeys | None) -> LoopSocket:
        """A DEALER connected to the link's URL, watched by a monitor when a drop is to be
        told."""
        limits, identity = self._limits, self.identity
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IMMEDIATE, 1)
        socket.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_IVL_MS)
        socket.setsockopt(zmq.MAXMSGSIZE, limits.max_frame_bytes)
        socket.setsockopt(zmq.IDENTITY, identity)
        if keys is not None:
            keys.apply(socket)
        if self._on_disconnect is not None:
            # Before the connect, so that no drop of the connection goes unseen.
            monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._monitor = LoopSocket(monitor, self._on_event)
            # One read now, which finds nothing: only a reader that found its queue empty
            # is signalled when the next event arrives (the descriptor fires on changes).
            self._monitor.pause()
            self._monitor.resume()
        socket.connect(self.url)
        return LoopSocket(socket, self._on_message)

    def _on_message(self, frames: Sequence[bytes | memoryview | zmq.Frame]) -> None:
        try:
            message = decode(
                frames,
                max_header_bytes=self._limits.max_header_bytes,
                max_payload_bytes=self._limits.max_payload_bytes,
            )
        except ProtocolError as exc:
            log.warning("sidecar_bad_reply", reason=str(exc))
            return
        request_id = message.request_id
        if not isinstance(request_id, int):
            return
        future = self._pending.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(message)
        elif "txn" in message.header:
            self._give_back(message)

    def _on_event(self, frames: list[zmq.Frame]) -> None:
        """A socket event: a dropped connection is told to ``on_disconnect`` on the next
        loop iteration (it closes this link, whose monitor is reading now)."""
        head = frames[0].bytes if frames else b""
        if len(head) != _EVENT_BYTES:  # not a monitor event (16-bit id, 32-bit value)
            return
        (event,) = struct.unpack_from("=H", head)
        if event & zmq.EVENT_DISCONNECTED and not self.dead and self._on_disconnect:
            asyncio.get_running_loop().call_soon(self._disconnected)

    def _disconnected(self) -> None:
        if not self.dead and self._on_disconnect is not None:
            self._on_disconnect(self)

    def _give_back(self, reply: Message) -> None:
        """End the transaction of a reply that came after its request timed out, so the
        server does not hold its memory until the transaction's deadline (best effort: a
        message the socket cannot take now is left to that deadline)."""
        txn = reply.header["txn"]
        if reply.type is MessageType.STORE:
            frames = encode(MessageType.COMMIT, {"txn": txn, "abort": True})
        elif reply.type in (MessageType.RETRIEVE, MessageType.LOOKUP):  # a lookup's lend
            frames = encode(MessageType.RELEASE, {"txn": txn, "loaded": 0})
        else:
            return
        with contextlib.suppress(zmq.ZMQError):
            self._socket.send_nowait(frames)

    async def request(
        self,
        msg_type: MessageType,
        header: dict[str, Any] | None,
        payloads: Sequence[object] = (),
        *,
        timeout: float,
        meanwhile: Callable[[], object] | None = None,
    ) -> Message:
        """Send a request and wait for its reply; ``meanwhile`` is called once the
        request is on its way, before the wait.

        Raises:
            Unavailable: the link is dead, the reply did not come in time, the server has
                no session for us or its engine is closed, or it failed internally.
            InvalidInputError: the server refused the request's input.
            ProtocolError: the server could not read the request.
        """
        if self.dead:
            raise Unavailable("the link is down")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._later or self._draining is not None:
            await self._later_first(msg_type, deadline)
        request_id = next(self._ids)
        frames = encode(msg_type, header, payloads, request_id=request_id)
        future: asyncio.Future[Message | None] = loop.create_future()
        self._pending[request_id] = future
        try:
            copy = _copy_frames(frames)
            if not self._socket.send_nowait(frames, copy=copy):
                async with asyncio.timeout_at(deadline):
                    await self._socket.send(frames, copy=copy)
            # The link's timer fails the future at the deadline: asyncio.timeout around
            # the await, or a timer per request, would cost every request far more.
            self._deadlines[request_id] = deadline
            if deadline < self._timer_at:
                self._arm(loop, deadline)
            if meanwhile is not None:
                meanwhile()
            reply = await future
        except TimeoutError:
            raise Unavailable(f"no reply to {msg_type.name} within {timeout} s") from None
        except zmq.ZMQError as exc:
            if self._socket.closed:  # the stream's end, met on this send: tell it now
                self._disconnected()
            raise Unavailable(f"{msg_type.name} failed: {exc}") from None
        finally:
            self._pending.pop(request_id, None)
            self._deadlines.pop(request_id, None)
        return _checked(msg_type, reply)

    def send_ahead(
        self,
        msg_type: MessageType,
        header: dict[str, Any],
        payloads: Sequence[object] = (),
        *,
        timeout: float,
    ) -> Sent | None:
        """Send a request now and wait for its reply later (:meth:`reply`), at most
        ``timeout`` seconds from now; None when the link is down or its socket cannot
        take the request at once. One that is never waited for is :meth:`forget`-ten."""
        if self.dead:
            return None
        if self._later:
            self._send_later()
        if self._draining is not None:
            return None  # it would pass the deferred messages
        request_id = next(self._ids)
        frames = encode(msg_type, header, payloads, request_id=request_id)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Message | None] = loop.create_future()
        try:
            if not self._socket.send_nowait(frames, copy=_copy_frames(frames)):
                return None
        except zmq.ZMQError:
            return None
        self._pending[request_id] = future
        deadline = loop.time() + timeout
        self._deadlines[request_id] = deadline
        if deadline < self._timer_at:
            self._arm(loop, deadline)
        return Sent(msg_type, request_id, future)

    async def reply(self, sent: Sent) -> Message:
        """The reply to a request :meth:`send_ahead` sent.

        Raises:
            Unavailable, InvalidInputError, ProtocolError: as :meth:`request`.
        """
        try:
            reply = await sent.future
        except TimeoutError:
            self.forget(sent)
            raise Unavailable(f"no reply to {sent.msg_type.name} in time") from None
        except BaseException:
            self.forget(sent)  # a reply that comes later is given back
            raise
        sent.answered = True  # taken here: not given back
        self.forget(sent)
        return _checked(sent.msg_type, reply)

    def forget(self, sent: Sent) -> None:
        """Stop waiting for a request :meth:`send_ahead` sent: its reply, come or to come,
        is dropped and its transaction given back."""
        self._pending.pop(sent.request_id, None)
        self._deadlines.pop(sent.request_id, None)
        future = sent.future
        if future.done() and not future.cancelled() and future.exception() is None:
            reply = future.result()
            if reply is not None and "txn" in reply.header and not sent.answered:
                self._give_back(reply)
        sent.answered = True

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = loop.call_at(when, self._expire_due, loop)

    def _expire_due(self, loop: asyncio.AbstractEventLoop) -> None:
        """Fail the requests whose deadline has come; arm the timer for the next one."""
        self._timer, self._timer_at = None, math.inf
        now = loop.time()
        for request_id, deadline in list(self._deadlines.items()):
            if deadline <= now:
                del self._deadlines[request_id]
                future = self._pending.get(request_id)
                if future is not None and not future.done():
                    future.set_exception(TimeoutError())
        if self._deadlines:
            self._arm(loop, min(self._deadlines.values()))

    async def notify(self, msg_type: MessageType, header: dict[str, Any], timeout: float) -> None:
        """Send a message that gets no reply (RELEASE, an aborted COMMIT); best effort,
        bounded by ``timeout`` and shielded, so it is sent even by a cancelled caller."""
        if self.dead:
            return
        frames = encode(msg_type, header)
        try:
            queued = self._later or self._draining is not None
            if not queued and self._socket.send_nowait(frames):
                return
            with anyio.CancelScope(shield=True), anyio.move_on_after(timeout):
                if queued:
                    await self._later_first(msg_type, anyio.current_time() + timeout)
                if not self._socket.send_nowait(frames):
                    await self._socket.send(frames)
        except (zmq.ZMQError, Unavailable):
            return

    def notify_soon(self, msg_type: MessageType, header: dict[str, Any], timeout: float) -> None:
        """Send a message that gets no reply (a RELEASE, a quiet COMMIT) off its caller's
        path: on the loop's next pass, or before this link's next message if that comes
        first, so the link's messages keep their order. Best effort within ``timeout``, as
        :meth:`notify`."""
        if self.dead:
            return
        loop = asyncio.get_running_loop()
        self._later.append((encode(msg_type, header), loop.time() + timeout))
        if not self._later_scheduled:
            self._later_scheduled = True
            loop.call_soon(self._send_later)

    def _send_later(self) -> None:
        """Send the deferred messages the socket takes now; the rest go in order from a
        task (:meth:`_drain_later`)."""
        self._later_scheduled = False
        later = self._later
        if self._draining is not None or self.dead:
            return
        try:
            while later and self._socket.send_nowait(later[0][0]):
                later.popleft()
        except zmq.ZMQError:
            later.clear()
        if later:
            self._draining = asyncio.get_running_loop().create_task(self._drain_later())

    async def _drain_later(self) -> None:
        """Send the deferred messages as the socket takes them, each by its deadline; at
        the first that misses it the rest are dropped too (the server's transaction
        deadlines end what they would have)."""
        later = self._later
        try:
            while later:
                frames, deadline = later[0]
                async with asyncio.timeout_at(deadline):
                    await self._socket.send(frames)
                later.popleft()
        except (TimeoutError, zmq.ZMQError):
            later.clear()
        finally:
            self._draining = None

    async def _later_first(self, msg_type: MessageType, deadline: float) -> None:
        """Send the deferred messages before a new one, waiting by ``deadline`` for those
        the socket cannot take now.

        Raises:
            Unavailable: they were not all sent by ``deadline``.
        """
        self._send_later()
        draining = self._draining
        if draining is None:
            return
        try:
            async with asyncio.timeout_at(deadline):
                await asyncio.shield(draining)
        except TimeoutError:
            raise Unavailable(f"{msg_type.name}: the link's queue is full") from None

    def close(self) -> None:
        """Close the socket; waiting requests fail at once. Deferred messages the socket
        takes at once are sent first."""
        if not self.dead and self._draining is None:
            self._send_later()
        if self._draining is not None:
            self._draining.cancel()
        self._later.clear()
        self.dead = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf
        for future in self._pending.values():
            if not future.done():
                future.set_result(None)
        self._pending.clear()
        socket = self._socket
        if self._monitor is not None and isinstance(socket, LoopSocket):
            self._monitor.detach()
            with contextlib.suppress(zmq.ZMQError):
                socket.socket.disable_monitor()
            self._monitor.close()
        socket.close()
        if self.segment is not None:
            self.segment.retire()


def _copy_frames(frames: Sequence[bytes | memoryview]) -> bool:
    """Whether to let ZeroMQ copy a message: below a few MiB a copy is cheaper than the
    zero-copy hand-off (which hands each frame's release to pyzmq's garbage thread)."""
    return sum(len(frame) for frame in frames) < _ZERO_COPY_BYTES
