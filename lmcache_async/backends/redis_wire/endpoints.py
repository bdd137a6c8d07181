"""Where a bulk connection goes and how it logs in: taken from redis-py's own settings.

An :class:`Endpoint` is read from the connection class and keyword arguments redis-py
would connect with (a standalone client's pool, or a cluster node): TCP host and port or
a Unix socket path, the TLS context redis-py builds for ``rediss://`` (certificates,
verification, hostname check), the credentials (user and password, or a credential
provider) and the database. :func:`open_stream` connects a :class:`~.stream.WireStream`
there and sends ``AUTH`` and ``SELECT`` as redis-py would, in one round trip.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from redis.credentials import CredentialProvider, UsernamePasswordCredentialProvider

from ...errors import ProtocolError
from .resp import ReplyError, command, read_reply
from .stream import WireStream

__all__ = ["Endpoint", "open_stream"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One server the bulk path connects to (``path`` set: a Unix socket)."""

    name: str
    """``host:port`` or the socket path: the key of its idle connections, for logs."""
    host: str = ""
    port: int = 0
    path: str = ""
    tls: ssl.SSLContext | None = field(default=None, compare=False)
    db: int = 0
    credentials: CredentialProvider | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, connection_class: type[Any], kwargs: Mapping[str, Any]) -> Endpoint:
        """The endpoint of a redis-py asyncio connection class and its keyword arguments
        (a connection object is made to read them; it never connects)."""
        conn = connection_class(**kwargs)
        path = str(getattr(conn, "path", "") or "")
        host = str(getattr(conn, "host", "") or "")
        port = int(getattr(conn, "port", 0) or 0)
        context = getattr(conn, "ssl_context", None)
        tls = context.get() if context is not None else None
        provider = conn.credential_provider
        if provider is None and (conn.username or conn.password):
            provider = UsernamePasswordCredentialProvider(conn.username, conn.password)
        return cls(
            name=path or f"{host}:{port}",
            host=host,
            port=port,
            path=path,
            tls=tls,
            db=int(conn.db or 0),
            credentials=provider,
        )


async def open_stream(endpoint: Endpoint) -> WireStream:
    """A new connection to ``endpoint``, logged in and on its database. The caller's
    deadline bounds the connect and the handshake.

    Raises:
        OSError: the connection failed or was lost.
        ProtocolError: the server refused the credentials or the database.
    """
    loop = asyncio.get_running_loop()
    if endpoint.path:
        transport, stream = await loop.create_unix_connection(WireStream, endpoint.path)
    else:
        transport, stream = await loop.create_connection(
            WireStream, endpoint.host, endpoint.port, ssl=endpoint.tls
        )
    try:
        await _handshake(stream, endpoint)
    except BaseException:
        transport.abort()
        raise
    return stream


async def _handshake(stream: WireStream, endpoint: Endpoint) -> None:
    commands: list[tuple[str, bytes]] = []
    if endpoint.credentials is not None:
        args = await endpoint.credentials.get_credentials_async()
        commands.append(("AUTH", command(b"AUTH", *(str(arg).encode() for arg in args))))
    if endpoint.db:
        commands.append(("SELECT", command(b"SELECT", str(endpoint.db).encode())))
    if not commands:
        return
    await stream.send([sent for _, sent in commands])
    for name, _ in commands:
        reply = await read_reply(stream)
        if reply != b"OK":
            detail = reply.message if isinstance(reply, ReplyError) else repr(reply)[:80]
            raise ProtocolError(f"redis refused {name} on {endpoint.name}: {detail}")
