"""A bare ZeroMQ echo server, the sidecar benchmark's transport baseline.

A ROUTER socket bound at a URL, read from the event loop's reader callback as the sidecar
reads its own (:class:`~lmcache_async.rpc.transport.LoopSocket`), sends every message back
unchanged. The benchmark times a round trip to it next to the sidecar's PING and lookup:
what remains above the echo is the sidecar's and its client's own work.

Run as ``python -m lmcache_async.bench.echo URL LIFETIME``: it serves until it is sent a
one-part ``stop`` message, is terminated, or ``LIFETIME`` seconds have passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Final

import zmq

from lmcache_async.rpc.transport import LoopSocket

STOP: Final = b"stop"
"""The one-part message that ends the server."""


async def serve(url: str, lifetime: float) -> None:
    """Echo every message at ``url`` until :data:`STOP` comes or ``lifetime`` passes."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(url)
    stopped = asyncio.Event()

    def on_message(frames: list[zmq.Frame]) -> None:
        if len(frames) == 2 and frames[1].bytes == STOP:
            stopped.set()
        else:
            io.send_nowait(frames)  # dropped if the client's queue is full: it times out

    io = LoopSocket(socket, on_message)
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(lifetime):
                await stopped.wait()
    finally:
        io.close()
        context.term()


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
