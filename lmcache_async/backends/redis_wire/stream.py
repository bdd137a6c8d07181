"""One connection of the bulk path: a :class:`asyncio.BufferedProtocol` that lets the
socket write a value straight into the memory its reader names.

The transport asks :meth:`WireStream.get_buffer` where to put the next bytes it receives.
While :meth:`WireStream.read_into` waits, that is the caller's destination itself (a pool
page): the kernel, or the TLS layer, copies the bytes there and nowhere else, and the
waiting task wakes once, when the destination is full. Otherwise bytes land in a small
scratch buffer (:data:`SCRATCH_BYTES`) from which reply lines and record headers are read;
when it is full of unread bytes, reading pauses until they are consumed, so a connection
never holds more than that. Nothing here pauses the reading of a value for flow control.

Writes leave from the caller's memory too. On a plain connection (TCP or Unix socket) they
go out with ``sendmsg`` on a second descriptor of the connection's socket (the transport
only reads): a command's framing, header and payload in one call, and what the kernel
does not take at once once the socket is writable again, never copied. Through TLS,
which must encrypt (copy) anyway, they go to the transport a piece at a time
(:data:`WRITE_PIECE`), each once the last is on its way to the socket.

A stream belongs to one task at a time for reading and one for writing. Waits have no
deadline of their own: every call that uses a stream runs under one
(:meth:`~lmcache_async.backends.redis_conn.RedisConnection.guard`), and a stream whose
call failed or was cancelled is aborted, never reused.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence
from typing import Final, cast

from ...errors import ProtocolError

__all__ = ["SCRATCH_BYTES", "WRITE_PIECE", "WireStream"]

SCRATCH_BYTES: Final = 64 * 1024
"""Bytes a connection buffers that no reader asked for yet (reply lines, record headers,
the first bytes of a value), and the longest reply line it accepts."""

WRITE_PIECE: Final = 256 * 1024
"""Most bytes handed to a TLS transport per write: the next piece waits while any of this
one is still encrypted but unsent, so smaller pieces buffer less but cost more trips
through the event loop."""

_NO_SIGNAL: Final = getattr(socket, "MSG_NOSIGNAL", 0)


class WireStream(asyncio.BufferedProtocol):
    """The protocol of one connection, and the reads and writes the bulk path makes on it.

    Reads raise :class:`ConnectionResetError` once the connection is lost, and
    :class:`~lmcache_async.errors.ProtocolError` for a reply line longer than
    :data:`SCRATCH_BYTES`.
    """

    def __init__(self) -> None:
        self._scratch = bytearray(SCRATCH_BYTES)
        self._view = memoryview(self._scratch)
        self._start = 0  # unread bytes are _scratch[_start:_end]
        self._end = 0
        self._dest: memoryview | None = None  # the destination of a read_into under way
        self._filled = 0
        self._landed: Callable[[memoryview], None] | None = None
        self._reader: asyncio.Future[None] | None = None
        self._writer: asyncio.Future[None] | None = None
        self._transport: asyncio.Transport | None = None
        self._sock: socket.socket | None = None  # the descriptor plain writes use
        self._lost: str | None = None
        self._read_paused = False
        self._write_paused = False
        self._spare = bytearray()

    # -- the transport's side -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and transport.get_extra_info("sslcontext") is None:
            self._sock = sock.dup()
        else:
            # A TLS write waits while encrypted bytes wait for the socket: see WRITE_PIECE.
            # (A high-water mark of 0 would pause the TLS layer after every write, and it
            # resumes only when its socket's buffer drains, which a write it sent whole
            # never fills.)
            self._transport.set_write_buffer_limits(high=1, low=0)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._dest is not None:
            return self._dest[self._filled :]
        size = len(self._scratch)
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start and size - self._end < size // 4:
            # Little room left behind the unread bytes: move them to the front, so that
            # the socket is never asked for a few bytes at a time.
            unread = self._end - self._start
            self._scratch[:unread] = self._view[self._start : self._end]
            self._start, self._end = 0, unread
        if self._end == size:
            # Reading pauses before this can happen (see buffer_updated).
            raise ProtocolError("redis reply buffer overflow")
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        dest = self._dest
        if dest is not None:
            if self._landed is not None:
                self._landed(dest[self._filled : self._filled + nbytes])
            self._filled += nbytes
            if self._filled == len(dest):
                self._dest = None
                _wake(self._reader)
            return
        self._end += nbytes
        _wake(self._reader)
        if self._end - self._start == len(self._scratch) and self._transport is not None:
            self._transport.pause_reading()
            self._read_paused = True

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost is None:
            self._lost = "closed by the server" if exc is None else repr(exc)
        self._dest = None
        self._landed = None
        _wake(self._reader)
        if self._writer is None:
            self._close_sock()
        else:
            _wake(self._writer)  # its send closes the descriptor once it stops waiting

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        _wake(self._writer)

    # -- state ----------------------------------------------------------------------------

    @property
    def reusable(self) -> bool:
        """Whether the connection is open with nothing unread or unsent: what a call that
        read every reply it asked for leaves, and what may serve the next call."""
        transport = self._transport
        return (
            self._lost is None
            and transport is not None
            and not transport.is_closing()
            and self._start == self._end
            and not self._read_paused
            and not self._write_paused
        )

    def close(self) -> None:
        """Close the connection (what the transport buffers is still sent)."""
        if self._transport is not None:
            self._transport.close()
        if self._writer is None:
            self._close_sock()

    def abort(self) -> None:
        """Close the connection at once, dropping whatever is buffered either way; a read
        under way gets no more bytes into its destination."""
        self._dest = None
        self._landed = None
        if self._lost is None:
            self._lost = "aborted"
        if self._transport is not None:
            self._transport.abort()
        if self._writer is None:
            self._close_sock()

    def _close_sock(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def spare(self, nbytes: int) -> memoryview:
        """A buffer of ``nbytes`` reused by the reads of this connection's call (for values
        that must be decoded before they reach their object). It grows to the largest
        value asked for, which the caller bounds, until :meth:`drop_spare`."""
        if len(self._spare) < nbytes:
            self._spare = bytearray(nbytes)
        return memoryview(self._spare)[:nbytes]

    def drop_spare(self) -> None:
        """Free the reusable buffer (an idle connection keeps none)."""
        self._spare = bytearray()

    # -- reads ----------------------------------------------------------------------------

    async def read_line(self) -> bytes:
        """The next line, without its ``\\r\\n``.

        Raises:
            ConnectionResetError: the connection was lost first.
            ProtocolError: no ``\\r\\n`` in :data:`SCRATCH_BYTES` bytes.
        """
        while True:
            at = self._scratch.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._view[self._start : at])
                self._consumed(at + 2 - self._start)
                return line
            if self._end - self._start == len(self._scratch):
                raise ProtocolError(f"redis reply line longer than {len(self._scratch)} bytes")
            await self._wait()

    async def read_exact(self, nbytes: int) -> bytes:
        """The next ``nbytes`` bytes (at most :data:`SCRATCH_BYTES`).

        Raises:
            ConnectionResetError: the connection was lost first.
        """
        if nbytes > len(self._scratch):
            raise ProtocolError(f"read of {nbytes} bytes through the scratch buffer")
        while self._end - self._start < nbytes:
            await self._wait()
        data = bytes(self._view[self._start : self._start + nbytes])
        self._consumed(nbytes)
        return data

    async def read_into(
        self, dest: memoryview, landed: Callable[[memoryview], None] | None = None
    ) -> None:
        """Fill ``dest`` (a writable byte view) with the next ``len(dest)`` bytes: those
        already buffered are copied, the rest are received straight into it. ``landed``
        is shown each piece of ``dest`` as it is filled, in order (a checksum computed
        while the bytes are fresh in the cache).

        If the wait ends early (cancelled, or the connection lost), no byte is written into
        ``dest`` after this returns or raises.

        Raises:
            ConnectionResetError: the connection was lost before ``dest`` was full.
        """
        size = len(dest)
        take = min(size, self._end - self._start)
        if take:
            dest[:take] = self._view[self._start : self._start + take]
            self._consumed(take)
            if landed is not None:
                landed(dest[:take])
        if take == size:
            return
        self._start = self._end = 0
        self._filled = take
        self._landed = landed
        self._dest = dest
        try:
            while self._filled < size:
                await self._wait()
        finally:
            self._dest = None
            self._landed = None

    async def skip(self, nbytes: int) -> None:
        """Read and drop the next ``nbytes`` bytes.

        Raises:
            ConnectionResetError: the connection was lost first.
        """
        while nbytes > 0:
            if self._start == self._end:
                await self._wait()
                continue
            take = min(nbytes, self._end - self._start)
            self._consumed(take)
            nbytes -= take

    def _consumed(self, nbytes: int) -> None:
        """Mark ``nbytes`` read. Reading, paused on a full buffer, resumes once the buffer
        is empty or a reader waits (:meth:`_wait`), not on every read from it: resumed
        after each header read out of a full buffer, the transport would receive a few
        bytes, fill it and pause again, several times a value (each a system call and a
        pass of the loop)."""
        self._start += nbytes
        if self._read_paused and self._start == self._end and self._transport is not None:
            self._read_paused = False
            self._transport.resume_reading()

    async def _wait(self) -> None:
        """Wait for the transport to deliver bytes (or fill the destination)."""
        if self._lost is not None:
            raise ConnectionResetError(f"redis connection lost: {self._lost}")
        if self._read_paused and self._transport is not None:
            self._read_paused = False
            self._transport.resume_reading()
        self._reader = asyncio.get_running_loop().create_future()
        try:
            await self._reader
        finally:
            self._reader = None

    # -- writes ---------------------------------------------------------------------------

    async def send(self, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        """Send ``parts`` (contiguous buffers: framing, headers, a payload where it lies)
        one after the other, each read from its own memory.

        Raises:
            ConnectionResetError: the connection was lost.
            OSError: the socket refused the bytes.
        """
        views = [memoryview(part).cast("B") for part in parts if len(part)]
        if self._sock is None:
            for view in views:
                await self._send_pieces(view)
            return
        while views:
            if self._lost is not None or self._sock is None:
                raise ConnectionResetError(f"redis connection lost: {self._lost}")
            try:
                sent = self._sock.sendmsg(views, (), _NO_SIGNAL)
            except (BlockingIOError, InterruptedError):
                sent = 0
            while views and sent >= len(views[0]):
                sent -= len(views.pop(0))
            if views:
                views[0] = views[0][sent:]
                await self._writable()

    async def _writable(self) -> None:
        """Wait until the plain socket takes bytes again."""
        sock = self._sock
        if sock is None:
            return
        loop = asyncio.get_running_loop()
        fd = sock.fileno()
        self._writer = loop.create_future()
        loop.add_writer(fd, _wake, self._writer)
        try:
            await self._writer
        finally:
            loop.remove_writer(fd)
            self._writer = None
            if self._lost is not None:
                self._close_sock()

    async def _send_pieces(self, view: memoryview) -> None:
        """Send ``view`` through the (TLS) transport piece by piece, each once the
        transport has sent everything before it."""
        for at in range(0, len(view), WRITE_PIECE):
            while self._write_paused:
                if self._lost is not None:
                    raise ConnectionResetError(f"redis connection lost: {self._lost}")
                self._writer = asyncio.get_running_loop().create_future()
                try:
                    await self._writer
                finally:
                    self._writer = None
            if self._lost is not None or self._transport is None:
                raise ConnectionResetError(f"redis connection lost: {self._lost}")
            self._transport.write(view[at : at + WRITE_PIECE])


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)
