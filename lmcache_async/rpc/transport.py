"""A ZeroMQ socket driven straight from the event loop's reader callback.

``zmq.asyncio`` makes every receive a future resolved by its own reader callback and then
a task wake-up; a request/reply round trip pays that on both ends, plus the hop from the
receive loop's task to the waiting caller. On a small machine that is most of a lookup's
round trip. :class:`LoopSocket` reads the socket's file descriptor itself: when it turns
readable, every waiting message is handed to a plain callback at once (which resolves the
caller's future or starts the handler's task); sends are non-blocking and only wait, with
a deadline, when the socket's queue is full or has no peer yet.

ZeroMQ's descriptor is edge-triggered: it signals that the socket's events *may* have
changed, and reading the socket's state, a receive or a send can each spend that signal
while messages are waiting. So the reader reads the state after every message it takes,
and a send reads it at once and hands the loop a drain (next iteration, never
re-entrantly) when a message already waits; a send from the reader callback leaves that
to the callback.

The module also holds what the ends agree on before any message: where a sidecar listens
by default (:func:`default_endpoint`), which addresses it may bind
(:func:`check_listen_url`: loopback unless remote binds are asked for) and the boot id that
tells two processes on one host apart from two hosts (:func:`boot_id`). CURVE keys are in
:mod:`lmcache_async.rpc.curve`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeAlias, cast

import zmq

from lmcache_async.errors import ConfigError
from lmcache_async.logging import get_logger

__all__ = [
    "FrameLike",
    "LoopSocket",
    "OnMessage",
    "boot_id",
    "check_listen_url",
    "default_endpoint",
]

log = get_logger(__name__)

FrameLike: TypeAlias = zmq.Frame | bytes | bytearray | memoryview
OnMessage: TypeAlias = Callable[[list[zmq.Frame]], None]

# pyzmq's constants are enum members: `events & zmq.POLLIN` builds a flag object (2 us
# here), and the reader tests events several times per message. Plain ints cost nothing.
_EVENTS: Final = int(zmq.EVENTS)
_POLLIN: Final = int(zmq.POLLIN)
_POLLOUT: Final = int(zmq.POLLOUT)
_NOBLOCK: Final = int(zmq.NOBLOCK)
_SNDMORE: Final = int(zmq.SNDMORE)

_LOOPBACK_NAMES: Final = frozenset({"localhost", "ip6-localhost"})
_UNIX_PATH_MAX: Final = 107  # sun_path holds 108 bytes with the final NUL


class LoopSocket:
    """Wraps ``socket`` (any ZeroMQ socket, e.g. of a ``zmq.asyncio`` context: its async
    methods must then not be used) for use on the running event loop.

    Messages received are passed to ``on_message`` in the loop's reader callback, in order;
    ``on_message`` must not block (it may start tasks). :meth:`pause` stops delivery (the
    messages wait in ZeroMQ's bounded queue) until :meth:`resume`.
    """

    def __init__(self, socket: zmq.Socket[Any], on_message: OnMessage) -> None:
        self.socket: zmq.Socket[Any] = zmq.Socket.shadow(socket.underlying)
        self._owner = socket  # keeps the wrapped socket (and its close) alive
        self._on_message = on_message
        self._loop = asyncio.get_running_loop()
        self._fd = cast(int, self.socket.getsockopt(zmq.FD))
        # Set when the socket may take a message again; exists only while a sender waits.
        self._writable: asyncio.Event | None = None
        self._send_waiters = 0
        self._paused = False
        self._drain_scheduled = False
        self._reading = False  # in the reader callback, which reads the state after each message
        self.closed = False
        self._loop.add_reader(self._fd, self._on_readable)

    def pause(self) -> None:
        """Stop delivering messages until :meth:`resume`."""
        self._paused = True

    def resume(self) -> None:
        """Deliver messages again (those that waited first, on the next loop iteration)."""
        if self._paused:
            self._paused = False
            self._schedule_drain()

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and not self.closed:
            self._drain_scheduled = True
            self._loop.call_soon(self._on_readable)

    def _on_readable(self) -> None:
        self._drain_scheduled = False
        self._reading = True
        try:
            # The descriptor fired, so a message most likely waits: receive it straight
            # away (the receive reads the socket's commands, as asking for its state
            # would), and ask for the state once per message after it. Asking first cost
            # a call per message for nothing.
            while not self.closed and not self._paused:
                try:
                    frames = self._receive()
                except zmq.Again:
                    if self._check_events():
                        continue  # it came meanwhile, and its edge is spent: take it
                    return
                self._on_message(frames)
                if not self._check_events():
                    return
            if not self.closed:
                self._check_events()  # paused: a sender may still wait for room
        except zmq.ZMQError as exc:
            if not self.closed:
                log.warning("zmq_receive_failed", error=str(exc))
        except BaseException:
            self._schedule_drain()  # messages after the one that failed are not stranded
            raise
        finally:
            self._reading = False

    def _check_events(self) -> bool:
        """Wake a waiting sender if the socket can take a message; whether one waits to be
        received."""
        events = self._events()
        if events & _POLLOUT and self._writable is not None:
            self._writable.set()
        return bool(events & _POLLIN)

    def _events(self) -> int:
        # EVENTS is an int; typing.cast would be one more call on every message.
        return self.socket.getsockopt(_EVENTS)  # type: ignore[return-value]

    def _receive(self) -> list[zmq.Frame]:
        """One whole message. ZeroMQ delivers the parts of a message together, and each
        part says whether more follow: a third of the time of ``recv_multipart``, which
        asks the socket after every part."""
        recv = self.socket.recv
        frame = recv(_NOBLOCK, copy=False)
        frames = [frame]
        while frame.more:
            frame = recv(_NOBLOCK, copy=False)
            frames.append(frame)
        return frames

    def send_nowait(self, frames: Sequence[FrameLike], *, copy: bool = True) -> bool:
        """Queue a message without waiting; False when the socket cannot take it now (its
        queue is full, or no peer is connected on an ``IMMEDIATE`` socket).

        Raises:
            zmq.ZMQError: the socket failed or is closed.
        """
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK)
        # Part by part rather than ``send_multipart`` (half the time: it checks every
        # part's type first). ZeroMQ takes a message whole or not at all: only the first
        # part can find the queue full.
        send, last = self.socket.send, len(frames) - 1
        try:
            for index, frame in enumerate(frames):
                send(frame, _NOBLOCK | _SNDMORE if index < last else _NOBLOCK, copy=copy)
        except zmq.Again:
            return False
        # A send can consume the descriptor's edge: read the socket's state now, and hand
        # the loop a drain only when a message (or room a sender waits for) is already
        # there. Otherwise the next message raises a new edge (one loop pass saved). A
        # reply sent from the reader callback needs neither: the callback reads the state
        # once the handler returns (each read costs ZeroMQ a system call).
        if self._reading:
            return True
        if self._events() & _POLLIN or self._writable is not None:
            self._schedule_drain()
        return True

    async def send(self, frames: Sequence[FrameLike], *, copy: bool = True) -> None:
        """Queue a message, waiting while the socket cannot take it; the caller bounds the
        wait (``asyncio.timeout``).

        Raises:
            zmq.ZMQError: the socket failed or is closed.
        """
        try:
            while not self.send_nowait(frames, copy=copy):
                if self.closed:
                    raise zmq.ZMQError(zmq.ENOTSOCK)
                if self._writable is None:
                    self._writable = asyncio.Event()
                self._writable.clear()
                # The descriptor only signals changes: look once more before sleeping on it.
                if self._events() & _POLLOUT:
                    continue
                writable = self._writable
                self._send_waiters += 1
                try:
                    await writable.wait()
                finally:
                    self._send_waiters -= 1
        finally:
            if not self._send_waiters:
                # Nobody waits: sends stop handing the loop a drain for a waiter.
                self._writable = None

    def detach(self) -> None:
        """Stop reading and sending; the socket stays open for its owner. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self._fd)
        if self._writable is not None:
            self._writable.set()

    def close(self) -> None:
        """Stop reading and close the socket at once (``linger`` 0). Idempotent."""
        self.detach()
        self._owner.close(linger=0)


# -- addresses and keys ------------------------------------------------------------------


def default_endpoint() -> str:
    """``ipc://{tempdir}/lmcache-async-sidecar-{uid}.sock``: one sidecar per user."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'lmcache-async-sidecar-{uid}.sock')}"


def check_listen_url(url: str, *, allow_remote: bool = False) -> str:
    """Validate a listen address: ``ipc://PATH`` or ``tcp://HOST:PORT``.

    A tcp address must name a loopback host (``127.0.0.1``, ``::1``, ``localhost``) unless
    ``allow_remote``: a wider bind exposes the cache (and ``clear``/``shutdown``) to the
    network, so it has to be asked for explicitly (and should use CURVE keys).

    Raises:
        ConfigError: ``field="listen"`` naming what is wrong.
    """
    if not isinstance(url, str):
        raise ConfigError("listen", f"expected a URL string, got {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("ipc", "tcp"):
        raise ConfigError("listen", f"expected ipc://PATH or tcp://HOST:PORT, got {url!r}")
    if scheme == "ipc":
        if not rest:
            raise ConfigError("listen", "ipc:// needs a socket path")
        if len(os.fsencode(rest)) > _UNIX_PATH_MAX:
            raise ConfigError(
                "listen", f"socket path {rest!r} is longer than {_UNIX_PATH_MAX} bytes"
            )
        return url
    host, colon, port = rest.rpartition(":")
    host = host.strip("[]")
    if not colon or not host or not (port.isdigit() or port == "*"):
        raise ConfigError("listen", f"expected tcp://HOST:PORT, got {url!r}")
    if not allow_remote and not _is_loopback(host):
        raise ConfigError(
            "listen",
            f"{url!r} binds beyond loopback; pass --allow-remote to serve other hosts "
            "(and --curve-secret-key-file to encrypt and authenticate the traffic)",
        )
    return url


def _is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def boot_id() -> str | None:
    """This machine's boot id (Linux), which with the host name tells "same host" apart."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None
