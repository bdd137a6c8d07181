"""A bare echo server, the sidecar benchmark's transport baseline, and the round trips to it.

A ROUTER socket bound at a URL, read from the event loop's reader callback as the sidecar
reads its own (:class:`~lmcache_async.rpc.transport.LoopSocket`), sends every message back
unchanged; beside an ``ipc://PATH`` URL it also echoes on the same-host stream socket
``PATH.stream`` (:mod:`lmcache_async.rpc.stream`), as a sidecar listens there. The
benchmark times round trips on both (:func:`round_trips`) next to the sidecar's PING and
lookup: what remains above the echo is the sidecar's and its client's own work.

Run as ``python -m lmcache_async.bench.echo URL LIFETIME``: it serves until it is sent a
one-part ``stop`` message (on either socket), is terminated, or ``LIFETIME`` seconds have
passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import anyio
import zmq

from lmcache_async.rpc.stream import (
    STREAM_SUFFIX,
    Outlets,
    StreamRouter,
    StreamSocket,
    bind_stream,
    connect_stream,
    stream_path,
)
from lmcache_async.rpc.transport import LoopSocket

__all__ = ["STOP", "EchoRoundTrips", "round_trips", "serve"]

STOP: Final = b"stop"
"""The one-part message that ends the server."""
_MAX_FRAME_BYTES: Final = 64 << 20
_STOP_TIMEOUT: Final = 10.0


async def serve(url: str, lifetime: float) -> None:
    """Echo every message at ``url`` (and its stream socket) until :data:`STOP` comes or
    ``lifetime`` passes."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(url)
    stopped = asyncio.Event()
    path = stream_path(url)
    listener = None if path is None else bind_stream(path)

    def on_message(frames: Sequence[Any]) -> None:
        if len(frames) == 2 and bytes(frames[1]) == STOP:
            stopped.set()
        else:  # to the socket the identity is of; dropped if its queue is full
            io.send_nowait(frames)

    router = None
    if listener is not None:
        router = StreamRouter(listener, on_message, max_frame_bytes=_MAX_FRAME_BYTES)
    io = Outlets(LoopSocket(socket, on_message), router)
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(lifetime):
                await stopped.wait()
    finally:
        io.detach()
        socket.close(linger=0)
        context.term()
        if listener is not None:
            listener.close()
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class EchoRoundTrips:
    """The round trips (seconds) of one message to the echo, over each transport."""

    def __init__(self) -> None:
        self.zeromq: list[float] = []
        self.stream: list[float] = []


async def round_trips(
    directory: str,
    frames: Sequence[bytes | memoryview],
    *,
    count: int,
    warmup: int,
    startup_timeout: float,
    request_timeout: float,
) -> EchoRoundTrips:
    """Start an echo in its own process on an ipc socket in ``directory`` and time ``count``
    round trips of ``frames`` (after ``warmup``) over ZeroMQ, then over the stream socket,
    each read from the event loop as the sidecar's client reads its replies.

    Raises:
        TimeoutError: the echo did not answer within ``startup_timeout`` at first, or
            within ``request_timeout`` later.
    """
    url = f"ipc://{os.path.join(directory, 'echo.sock')}"
    process = _start(url, startup_timeout + 2 * (count + warmup + 2) * request_timeout)
    replies: asyncio.Queue[None] = asyncio.Queue(maxsize=1)
    result = EchoRoundTrips()

    async def timed(send: Callable[[Sequence[Any]], Awaitable[None]], out: list[float]) -> None:
        for i in range(1 + warmup + count):
            with anyio.fail_after(startup_timeout if i == 0 else request_timeout):
                started = time.perf_counter()
                await send(frames)
                await replies.get()
                elapsed = time.perf_counter() - started
            if i > warmup:
                out.append(elapsed)

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IMMEDIATE, 1)  # a send waits until the echo is there
        socket.connect(url)
        io = LoopSocket(socket, lambda _: replies.put_nowait(None))
        try:
            await timed(io.send, result.zeromq)
        finally:
            io.close()
        # Bound before the ZeroMQ echo answered.
        stream = StreamSocket(
            connect_stream(f"{url.removeprefix('ipc://')}{STREAM_SUFFIX}"),
            lambda _: replies.put_nowait(None),
            max_frame_bytes=_MAX_FRAME_BYTES,
        )
        try:
            await timed(stream.send, result.stream)
            stream.send_nowait([STOP])
        finally:
            stream.close()
    finally:
        context.term()
        await _stopped(process)
    return result


def _start(url: str, lifetime: float) -> subprocess.Popen[bytes]:
    """Start this module's echo at ``url``, to end by itself after ``lifetime`` seconds."""
    command = [sys.executable, "-m", "lmcache_async.bench.echo", url, str(lifetime)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL)


async def _stopped(process: subprocess.Popen[bytes]) -> None:
    """Wait for the echo to end (it was told to stop); then SIGTERM, SIGKILL."""
    for end in (None, process.terminate, process.kill):
        if end is not None:
            with contextlib.suppress(ProcessLookupError):
                end()
        with contextlib.suppress(subprocess.TimeoutExpired):
            await anyio.to_thread.run_sync(process.wait, _STOP_TIMEOUT)
            return


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m lmcache_async.bench.echo URL LIFETIME_SECONDS", file=sys.stderr)
        return 2
    try:
        lifetime = float(args[1])
    except ValueError:
        print(f"LIFETIME_SECONDS must be a number, got {args[1]!r}", file=sys.stderr)
        return 2
    asyncio.run(serve(args[0], lifetime))
    return 0


if __name__ == "__main__":
    sys.exit(main())
