"""What a sidecar request handler is, and the table entry that routes a message type to it.

A handler takes the client's session (None for a request that needs none) and the decoded
request; it returns the reply's header and payloads, or None for a message that gets no
reply (RELEASE). Raising ProtocolError, InvalidInputError, EngineClosedError,
PermissionDeniedError or :class:`Busy` turns into an ERROR reply with the matching code;
anything else into an ``INTERNAL`` one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from lmcache_async.rpc.protocol import Message, MessageType
from lmcache_async.rpc.sidecar.sessions import Busy, Session

__all__ = ["TIMED_OPERATIONS", "Busy", "Handler", "NowHandler", "Reply", "Route"]

Reply: TypeAlias = tuple[dict[str, Any], Sequence[object]]
Handler: TypeAlias = Callable[[Session | None, Message], Awaitable[Reply | None]]
NowHandler: TypeAlias = Callable[[Session | None, Message], dict[str, Any] | None]

TIMED_OPERATIONS: Final = {
    MessageType.LOOKUP: "lookup",
    MessageType.PREFETCH: "prefetch",
    MessageType.STORE: "store",
    MessageType.COMMIT: "commit",
    MessageType.RETRIEVE: "retrieve",
}
"""Requests whose time in the server is tracked (STATS latencies, Prometheus histogram):
``store`` hashes and allocates, ``commit`` caches what the client copied in."""


@dataclass(frozen=True, slots=True)
class Route:
    """One message type's handler, and what it needs before it may run: the client's
    session (else a ``NO_SESSION`` error), an open engine (else ``ENGINE_CLOSED``), an
    admin's certificate (else ``FORBIDDEN``)."""

    handler: Handler
    needs_session: bool
    needs_engine: bool
    now: NowHandler | None = None
    """Answers the request at once, in the socket's reader callback (a reply header, no
    payloads), or returns None when it must wait: ``handler`` then serves it in a task."""
    admin: bool = False
    """Only an admin may send it (erase, clear, freeze, hot-cache, move, shut down)."""
    for_clients: Handler | None = None
    """What a client certificate gets instead of ``handler`` (STATS without tenants)."""
