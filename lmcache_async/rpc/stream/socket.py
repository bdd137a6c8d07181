"""One connected Unix stream socket carrying ZeroMQ-shaped messages, driven straight from
the event loop's reader and writer callbacks.

A message is a list of frames. On the stream it is a prefix, ``<I`` the length of what
follows and ``<H`` the frame count, then each frame's length (``<I``) and the frames'
bytes. A message is sent with one ``sendmsg`` of the prefix and the frames (no join);
what the kernel does not take at once is kept, in order, and written when the socket is
writable again. Received bytes are read into one reused buffer and every whole message in
it is handed to ``on_message`` in the reader callback; a message larger than the buffer is
gathered as its bytes arrive (so memory follows what the peer actually sent).

A peer that breaks the framing (no frame, a frame over ``max_frame_bytes``, lengths that
do not add up) is disconnected, as ZeroMQ drops a peer that sends an oversized frame; a
closed or failed connection is told to ``on_closed`` on the loop's next pass.

Errors are raised as :class:`zmq.ZMQError`, as :class:`~lmcache_async.rpc.transport.LoopSocket`
raises them, so callers handle both transports alike.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Final

import zmq

from lmcache_async.logging import get_logger
from lmcache_async.rpc.transport import FrameLike

__all__ = ["MAX_FRAMES", "StreamSocket", "encode_message"]

log = get_logger(__name__)

_PREFIX: Final = struct.Struct("<IH")
_LENGTH: Final = struct.Struct("<I")
MAX_FRAMES: Final = 0xFFFF
"""The most frames one message may have (the count is 16 bits)."""
_READ_BYTES: Final = 256 << 10
"""The reused receive buffer: every request and reply of the data path fits in it."""
_HIGH_WATER_BYTES: Final = 16 << 20
"""Unsent bytes past which :meth:`StreamSocket.send_nowait` refuses a new message."""
_IOV_MAX: Final = 1000
"""Frames per ``sendmsg`` call (the kernel takes at most 1024 pieces)."""

OnStreamMessage = Callable[[list[bytes | memoryview]], None]


def encode_message(
    frames: Sequence[FrameLike],
) -> tuple[list[bytes | memoryview], list[int]]:
    """The pieces of one message on the stream, its prefix then its frames (not copied),
    and each piece's size in bytes.

    Raises:
        ValueError: no frame, more than :data:`MAX_FRAMES`, or over 4 GiB in all.
    """
    views = [
        frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame) for frame in frames
    ]
    count = len(views)
    if not 0 < count <= MAX_FRAMES:
        raise ValueError(f"a message has 1 to {MAX_FRAMES} frames, not {count}")
    lengths = [view.nbytes for view in views]
    body = 4 * count + sum(lengths)
    if body > 0xFFFFFFFF:
        raise ValueError(f"a message of {body} bytes is over the stream's 4 GiB")
    prefix = _PREFIX.pack(body, count) + struct.pack(f"<{count}I", *lengths)
    return [prefix, *views], [len(prefix), *lengths]


class StreamSocket:
    """A connected stream socket (made non-blocking here) read in the loop's reader
    callback; ``on_message`` gets each whole message's frames, in order, and must not
    block. ``on_closed`` is called once, on the loop's next pass, when the connection
    closes or fails (not after :meth:`close`)."""

    def __init__(
        self,
        sock: socket.socket,
        on_message: OnStreamMessage,
        *,
        max_frame_bytes: int,
        on_closed: Callable[[], None] | None = None,
    ) -> None:
        sock.setblocking(False)
        self.socket = sock
        self._on_message = on_message
        self._on_closed = on_closed
        self._max_frame_bytes = max_frame_bytes
        self._loop = asyncio.get_running_loop()
        self._fd = sock.fileno()
        self._buffer = bytearray(_READ_BYTES)
        self._view = memoryview(self._buffer)
        self._filled = 0  # bytes at the buffer's start: the beginning of a message
        self._large: bytearray | None = None  # a message larger than the buffer, gathering
        self._large_bytes = 0  # its whole size
        self._out: collections.deque[memoryview] = collections.deque()
        self._out_bytes = 0
        self._writable: asyncio.Event | None = None
        self.closed = False
        self._loop.add_reader(self._fd, self._on_readable)

    # -- reading ---------------------------------------------------------------------------

    def _on_readable(self) -> None:
        try:
            if self._large is not None:
                self._read_large()
                return
            received = self.socket.recv_into(self._view[self._filled :])
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lost(str(exc))
            return
        if not received:
            self._lost("closed by the peer")
            return
        self._take(self._filled + received)

    def _take(self, end: int) -> None:
        """Deliver the whole messages in ``buffer[:end]``; keep the part of the next."""
        buffer, view, start = self._buffer, self._view, 0
        while end - start >= _PREFIX.size and not self.closed:
            body, count = _PREFIX.unpack_from(buffer, start)
            size = _PREFIX.size + body
            if end - start < size:
                if size > len(buffer):  # gathered on its own as it arrives
                    self._large = bytearray(view[start:end])
                    self._large_bytes = size
                    self._filled = 0
                    return
                break
            frames = self._frames(view, start, body, count, copy=True)
            if frames is None:
                return
            start += size
            self._on_message(frames)
        rest = end - start
        if start and rest:
            buffer[:rest] = view[start:end]  # same length: the exported view stays valid
        self._filled = rest

    def _read_large(self) -> None:
        large = self._large
        assert large is not None
        want = min(self._large_bytes - len(large), _READ_BYTES)
        data = self.socket.recv(want)
        if not data:
            self._lost("closed by the peer")
            return
        large += data
        if len(large) < self._large_bytes:
            return
        self._large = None
        body, count = _PREFIX.unpack_from(large, 0)
        frames = self._frames(memoryview(large), 0, body, count, copy=False)
        if frames is not None:
            self._on_message(frames)

    def _frames(
        self, view: memoryview, start: int, body: int, count: int, *, copy: bool
    ) -> list[bytes | memoryview] | None:
        """The frames of the message at ``view[start:]`` (copies when ``copy``: the buffer
        is reused); None when its framing is broken (the peer is then disconnected)."""
        table = _PREFIX.size + 4 * count
        if count == 0 or body < 4 * count:
            self._refuse(f"a message of {count} frames in {body} bytes")
            return None
        lengths = struct.unpack_from(f"<{count}I", view, start + _PREFIX.size)
        if sum(lengths) != body - 4 * count or max(lengths) > self._max_frame_bytes:
            self._refuse(
                f"frame lengths that do not fit the message or the limit {self._max_frame_bytes}"
            )
            return None
        frames: list[bytes | memoryview] = []
        offset = start + table
        for length in lengths:
            piece = view[offset : offset + length]
            frames.append(bytes(piece) if copy else piece)
            offset += length
        return frames

    def _refuse(self, reason: str) -> None:
        log.warning("stream_peer_refused", reason=reason)
        self._lost(reason)

    # -- writing ---------------------------------------------------------------------------

    def send_nowait(self, frames: Sequence[FrameLike], *, copy: bool = True) -> bool:
        """Queue a message; False when the socket holds too many unsent bytes to take it
        now. The frames are not used after the call (what the kernel did not take is
        copied); ``copy`` is accepted for :class:`~lmcache_async.rpc.transport.LoopSocket`'s
        signature.

        Raises:
            zmq.ZMQError: the connection is closed or failed.
        """
        del copy
        if self.closed:
            raise zmq.ZMQError(errno.ENOTCONN)
        pieces, sizes = encode_message(frames)
        if self._out:
            if self._out_bytes >= _HIGH_WATER_BYTES:
                return False
            self._keep(pieces, 0)
            return True
        sent = 0
        try:
            for first in range(0, len(pieces), _IOV_MAX):
                group = pieces[first : first + _IOV_MAX]
                done = self.socket.sendmsg(group)
                sent += done
                if done < sum(sizes[first : first + _IOV_MAX]):
                    break
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self._lost(str(exc))
            raise zmq.ZMQError(errno.ENOTCONN) from None
        self._keep(pieces, sent)
        return True

    def _keep(self, pieces: Sequence[bytes | memoryview], skip: int) -> None:
        """Keep what is left of a message after its first ``skip`` bytes went out."""
        rest = bytearray()
        for piece in pieces:
            view = memoryview(piece)
            if skip >= view.nbytes:
                skip -= view.nbytes
                continue
            rest += view[skip:]
            skip = 0
        if not rest:
            return
        if not self._out:
            self._loop.add_writer(self._fd, self._on_writable)
        self._out.append(memoryview(rest))
        self._out_bytes += len(rest)

    def _on_writable(self) -> None:
        out = self._out
        try:
            while out:
                head = out[0]
                sent = self.socket.send(head)
                self._out_bytes -= sent
                if sent < head.nbytes:
                    out[0] = head[sent:]
                    break
                out.popleft()
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self._lost(str(exc))
            return
        if not out:
            self._loop.remove_writer(self._fd)
        if self._writable is not None and self._out_bytes < _HIGH_WATER_BYTES:
            self._writable.set()

    async def send(self, frames: Sequence[FrameLike], *, copy: bool = True) -> None:
        """Queue a message, waiting while the socket holds too many unsent bytes; the
        caller bounds the wait (``asyncio.timeout``).

        Raises:
            zmq.ZMQError: the connection is closed or failed.
        """
        while not self.send_nowait(frames, copy=copy):
            if self._writable is None:
                self._writable = asyncio.Event()
            self._writable.clear()
            await self._writable.wait()

    @property
    def unsent_bytes(self) -> int:
        """Bytes queued but not yet taken by the kernel."""
        return self._out_bytes

    # -- closing ---------------------------------------------------------------------------

    def _lost(self, reason: str) -> None:
        if self.closed:
            return
        log.debug("stream_closed", reason=reason)
        self.close()
        if self._on_closed is not None:
            self._loop.call_soon(self._on_closed)

    def close(self) -> None:
        """Close the connection at once; a sender waiting for room fails. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self._fd)
        if self._out:
            self._loop.remove_writer(self._fd)
            self._out.clear()
            self._out_bytes = 0
        self._large = None
        if self._writable is not None:
            self._writable.set()
        self.socket.close()
