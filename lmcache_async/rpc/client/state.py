"""What a client knows of its connection to the sidecar: whether it is connected and
healthy, over which transport, and what the sidecar said in its welcome."""

from __future__ import annotations

from lmcache_async.keys.chunks import ChunkHasher
from lmcache_async.rpc.client.connection import Connection

__all__ = ["ConnectionState"]


class ConnectionState:
    """The connection methods of :class:`~.remote.RemoteCacheEngine` (over its ``_conn``)."""

    _conn: Connection

    async def wait_connected(self) -> None:
        """Wait until the client has a session with the sidecar (bound the wait with
        ``anyio.fail_after``). Raises EngineClosedError when the client is closed."""
        self._conn.check_open()
        await self._conn.connected.wait()

    def is_healthy(self) -> bool:
        """True while connected to a sidecar whose last heartbeat said it can serve."""
        conn = self._conn
        return not conn.closed and conn.link is not None and conn.healthy

    @property
    def uses_stream(self) -> bool:
        """Whether requests go over the sidecar's same-host stream socket now (else
        ZeroMQ)."""
        link = self._conn.link
        return link is not None and link.stream

    @property
    def uses_shared_memory(self) -> bool:
        """Whether payloads move through the sidecar's shared memory now (else inline)."""
        link = self._conn.link
        return link is not None and link.segment is not None

    @property
    def key_hasher(self) -> ChunkHasher | None:
        """The hasher of this client's chunk keys as the sidecar computes them (None
        before the first hello, or when the sidecar did not say how it hashes)."""
        return self._conn.hasher

    @property
    def chunk_size(self) -> int | None:
        """The sidecar's chunk size (None before the first hello)."""
        welcome = self._conn.welcome
        return None if welcome is None else welcome.chunk_size
