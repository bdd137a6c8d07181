"""The sidecar's stream listener, where its socket file lives, and how a client reaches it.

:class:`StreamRouter` accepts connections on a listening Unix socket and gives each an
identity, as a ZeroMQ ROUTER does: a message arrives as ``[identity, *frames]`` and a reply
``[identity, *frames]`` goes to that connection (dropped when it is gone). Identities
start with a zero byte and are ten bytes long: ZeroMQ reserves identities that start with
a zero byte for the five-byte ones it makes itself, so no ZeroMQ peer can name one.

The socket file is made readable and writable by its owner only, and a connection from
another user (``SO_PEERCRED``; root included, who ignores file modes) is closed before any
of its bytes is read: the host's users are the boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Final

import zmq

from lmcache_async.logging import get_logger
from lmcache_async.rpc.stream.socket import StreamSocket
from lmcache_async.rpc.transport import FrameLike, LoopSocket

__all__ = [
    "STREAM_SUFFIX",
    "IDENTITY_PREFIX",
    "Outlets",
    "StreamRouter",
    "bind_stream",
    "connect_stream",
    "stream_path",
]

log = get_logger(__name__)

STREAM_SUFFIX: Final = ".stream"
"""What the stream socket's path adds to the ``ipc://`` path of its sidecar."""
IDENTITY_PREFIX: Final = b"\x00s"
_UNIX_PATH_MAX: Final = 107
_BACKLOG: Final = 128
_PEERCRED: Final = struct.Struct("3i")  # pid, uid, gid

OnRoutedMessage = Callable[[list[FrameLike]], None]


def stream_path(url: str) -> str | None:
    """The stream socket's path beside the sidecar at ``url``: ``PATH.stream`` for
    ``ipc://PATH``; None for any other address, or when that path is too long for a Unix
    socket."""
    if not url.startswith("ipc://"):
        return None
    path = url.removeprefix("ipc://") + STREAM_SUFFIX
    return path if len(os.fsencode(path)) <= _UNIX_PATH_MAX else None


def bind_stream(path: str) -> socket.socket:
    """A listening Unix stream socket at ``path`` (a stale file there is replaced, as
    ZeroMQ replaces an ``ipc://`` file), readable and writable by its owner only.

    Raises:
        OSError: it cannot be bound.
    """
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        # Another user connecting before this is closed on accept (SO_PEERCRED).
        os.chmod(path, 0o600)
        sock.listen(_BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def connect_stream(path: str) -> socket.socket:
    """A socket connected to the stream listener at ``path``.

    Raises:
        OSError: nothing listens there (or its backlog is full).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock


def _peer_uid(sock: socket.socket) -> int | None:
    try:
        cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    except (OSError, AttributeError):
        return None
    return int(_PEERCRED.unpack(cred)[1])


class StreamRouter:
    """Accepts connections on ``listener`` and routes messages by identity, as a ZeroMQ
    ROUTER: ``on_message`` gets ``[identity, *frames]`` in the reader callback (it must not
    block); :meth:`send_nowait` takes ``[identity, *frames]``. Only connections of the user
    ``uid`` (default: this process's) are admitted; root's too are closed (it reaches
    another user's sidecar over ZeroMQ). ``on_gone`` is told the identity of each
    connection that closes (not of those :meth:`detach` closes)."""

    def __init__(
        self,
        listener: socket.socket,
        on_message: OnRoutedMessage,
        *,
        max_frame_bytes: int,
        uid: int | None = None,
        on_gone: Callable[[bytes], None] | None = None,
    ) -> None:
        self._listener = listener
        self._on_message = on_message
        self._on_gone = on_gone
        self._max_frame_bytes = max_frame_bytes
        self._loop = asyncio.get_running_loop()
        self._peers: dict[bytes, StreamSocket] = {}
        self._serial = itertools.count(1)
        self._uid = os.getuid() if uid is None else uid
        self.closed = False
        self._loop.add_reader(listener.fileno(), self._accept)

    @property
    def peers(self) -> int:
        """Connections open now."""
        return len(self._peers)

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("stream_accept_failed", error=str(exc))
                return
            uid = _peer_uid(conn)
            if uid != self._uid:
                log.warning("stream_peer_of_another_user", uid=uid)
                conn.close()
                continue
            identity = IDENTITY_PREFIX + next(self._serial).to_bytes(8, "big")
            self._peers[identity] = StreamSocket(
                conn,
                functools.partial(self._deliver, identity),
                max_frame_bytes=self._max_frame_bytes,
                on_closed=functools.partial(self._gone, identity),
            )

    def _deliver(self, identity: bytes, frames: list[bytes | memoryview]) -> None:
        self._on_message([identity, *frames])

    def _gone(self, identity: bytes) -> None:
        if self._peers.pop(identity, None) is not None and self._on_gone is not None:
            self._on_gone(identity)

    def send_nowait(self, frames: Sequence[FrameLike], *, copy: bool = True) -> bool:
        """Queue ``frames[1:]`` to the connection ``frames[0]`` names (dropped, as a
        ROUTER drops it, when that connection is gone); False when it cannot take it now.

        Raises:
            zmq.ZMQError: the router is closed.
        """
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK)
        identity = frames[0]
        peer = self._peers.get(identity) if isinstance(identity, bytes) else None
        if peer is None or peer.closed:
            return True
        return peer.send_nowait(frames[1:], copy=copy)

    def detach(self) -> None:
        """Stop accepting and close every connection (the listener stays open for its
        owner). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self._listener.fileno())
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()


class Outlets:
    """Where a sidecar's replies go: to the stream router for its identities, to the
    ZeroMQ socket for the rest (whose identity frames are never ``bytes`` starting with
    :data:`IDENTITY_PREFIX`)."""

    def __init__(self, zmq_io: LoopSocket, stream: StreamRouter | None) -> None:
        self.zmq = zmq_io
        self.stream = stream

    @property
    def closed(self) -> bool:
        return self.zmq.closed

    def send_nowait(self, frames: Sequence[FrameLike], *, copy: bool = True) -> bool:
        """Queue a reply ``[identity, *frames]`` on the socket its identity belongs to.

        Raises:
            zmq.ZMQError: that socket is closed or failed.
        """
        identity = frames[0]
        stream = self.stream
        if stream is not None and isinstance(identity, bytes) and identity[:2] == IDENTITY_PREFIX:
            return stream.send_nowait(frames, copy=copy)
        return self.zmq.send_nowait(frames, copy=copy)

    def detach(self) -> None:
        """Stop both sockets. Idempotent."""
        self.zmq.detach()
        if self.stream is not None:
            self.stream.detach()
