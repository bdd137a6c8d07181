"""A same-host sidecar's Unix stream socket: the request path without ZeroMQ's I/O threads.

Over ZeroMQ a request and its reply pass four threads (the client's I/O thread, the
sidecar's, and back), each a wake-up; on a small machine that is most of a lookup's round
trip. A sidecar listening on ``ipc://PATH`` without CURVE keys also listens on the Unix
stream socket ``PATH.stream`` (mode 0600, peers of its own user only), and a client that
finds that file talks to it directly from its event loop: one system call to send, one
wake-up to read. Messages keep their ZeroMQ shape (a list of frames); only the framing
differs (:mod:`~.socket`). ZeroMQ stays for everything else: CURVE, remote hosts, the
lookup service, events.

Modules: :mod:`~.socket` (:class:`StreamSocket`, one connected socket driven by the event
loop's callbacks, and the framing) and :mod:`~.router` (:class:`StreamRouter`, the
sidecar's listener: a ROUTER's identities over accepted connections; where the socket
file lives).

May import: the ground floor (errors, logging) and ``rpc.transport``.
"""

from __future__ import annotations

from lmcache_async.rpc.stream.router import (
    STREAM_SUFFIX,
    Outlets,
    StreamRouter,
    bind_stream,
    connect_stream,
    stream_path,
)
from lmcache_async.rpc.stream.socket import StreamSocket

__all__ = [
    "STREAM_SUFFIX",
    "Outlets",
    "StreamRouter",
    "StreamSocket",
    "bind_stream",
    "connect_stream",
    "stream_path",
]
