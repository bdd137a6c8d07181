"""The bulk path's connections: one server's, or each cluster primary's, kept idle between
calls, and the keys of a call split among them.

:class:`WireClient` follows the redis-py client it is given: a standalone client's
connection settings, or a cluster client's topology (each key's slot from redis-py's
:func:`~redis.crc.key_slot`, its primary from the client's slot map). A call that spans
several nodes runs each node's keys on that node's connection, all at once. A ``MOVED``
or ``ASK`` answer counts its key as absent (not stored) and has the slot map refreshed
before the next call; any other error reply becomes redis-py's ``ResponseError``, for the
caller's boundary to map.

A connection whose call failed or was cancelled is aborted; one that finished cleanly is
kept for the next call (up to :data:`MAX_IDLE` per server, each with its 64 KiB scratch
buffer and no other). One the server closed while idle is noticed (the loop reads its
end of stream) and dropped when next taken.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, TypeVar

from redis import exceptions as redis_errors
from redis.crc import key_slot

from lmcache_async.logging import get_logger

from .endpoints import Endpoint, open_stream
from .exists import exists_each
from .gets import ValueSink, get_values
from .overlap import concurrently
from .resp import ReplyError
from .sets import Encode, Replied, set_values
from .stream import WireStream

__all__ = ["MAX_IDLE", "WireClient"]

log = get_logger(__name__)

MAX_IDLE: Final = 8
"""Idle connections kept per server (more are opened while calls overlap)."""

T = TypeVar("T")
Groups = list[tuple[Endpoint, list[int]]]


class WireClient:
    """The bulk ``GET`` and ``SET`` of a redis-py ``client`` (``cluster``: a
    ``RedisCluster``), on connections of its own.

    Every call runs under its caller's deadline; errors are left as they come
    (``OSError``, :class:`~lmcache_async.errors.ProtocolError`, redis-py's
    ``ResponseError`` and cluster errors) for that caller to map.
    """

    def __init__(self, client: Any, *, cluster: bool) -> None:
        self._client = client
        self._cluster = cluster
        self._endpoints: dict[str, Endpoint] = {}
        self._idle: dict[str, list[WireStream]] = {}
        self._in_use = 0
        self._stale = False
        self._closed = False

    @property
    def in_use(self) -> int:
        """Connections a call holds now."""
        return self._in_use

    @property
    def idle(self) -> dict[str, int]:
        """Idle connections kept, by server (``host:port`` or socket path)."""
        return {name: len(streams) for name, streams in self._idle.items() if streams}

    async def get(self, rkeys: Sequence[bytes], indices: Sequence[int], sink: ValueSink) -> None:
        """``GET`` ``rkeys`` into ``sink`` (``indices``: their numbers for it), a pipelined
        round trip per server, the servers at once."""

        async def work(stream: WireStream, picks: list[int]) -> list[ReplyError]:
            return await get_values(
                stream, [rkeys[p] for p in picks], [indices[p] for p in picks], sink
            )

        await self._spread("get", rkeys, work)

    async def exists(self, rkeys: Sequence[bytes]) -> list[bool]:
        """Whether the server holds each of ``rkeys``: a pipelined round trip per server,
        the servers at once. A key another cluster node serves counts as absent."""
        present = [False] * len(rkeys)

        async def work(stream: WireStream, picks: list[int]) -> list[ReplyError]:
            return await exists_each(stream, [rkeys[p] for p in picks], picks, present)

        await self._spread("exists", rkeys, work)
        return present

    async def set(
        self,
        rkeys: Sequence[bytes],
        indices: Sequence[int],
        encode: Encode,
        replied: Replied,
        *,
        ttl_ms: int | None,
    ) -> None:
        """``SET NX`` each of ``rkeys`` to ``encode(indices[n])``, a pipelined stream per
        server, the servers at once; ``replied`` hears each answer."""

        async def work(stream: WireStream, picks: list[int]) -> list[ReplyError]:
            return await set_values(
                stream,
                [rkeys[p] for p in picks],
                [indices[p] for p in picks],
                encode,
                replied,
                ttl_ms=ttl_ms,
            )

        await self._spread("set", rkeys, work)

    def discard_idle(self) -> None:
        """Close every idle connection (the server went away, or the client closes)."""
        for streams in self._idle.values():
            for stream in streams:
                stream.close()
            streams.clear()

    def aclose(self) -> None:
        """Close the idle connections; those in use close when their call ends."""
        self._closed = True
        self.discard_idle()

    # -- routing --------------------------------------------------------------------------

    async def _spread(
        self,
        op: str,
        rkeys: Sequence[bytes],
        work: Callable[[WireStream, list[int]], Awaitable[list[ReplyError]]],
    ) -> None:
        errors: list[ReplyError] = []

        async def on(endpoint: Endpoint, picks: list[int]) -> None:
            errors.extend(await self._on(endpoint, lambda stream: work(stream, picks)))

        groups = await self._groups(rkeys)
        await concurrently(*(functools.partial(on, endpoint, picks) for endpoint, picks in groups))
        if any(error.redirect for error in errors):
            self._stale = True
            log.info("redis_cluster_redirect", op=op, keys=sum(e.redirect for e in errors))
        refused = [error for error in errors if not error.redirect]
        if refused:
            raise redis_errors.ResponseError(f"{op}: {refused[0].message}")

    async def _groups(self, rkeys: Sequence[bytes]) -> Groups:
        """The servers ``rkeys`` live on, each with the positions of its keys."""
        if not self._cluster:
            endpoint = self._endpoints.get("")
            if endpoint is None:
                pool = self._client.connection_pool
                endpoint = Endpoint.of(pool.connection_class, pool.connection_kwargs)
                self._endpoints[""] = endpoint
            return [(endpoint, list(range(len(rkeys))))]
        nodes = await self._topology()
        groups: dict[str, tuple[Endpoint, list[int]]] = {}
        for position, rkey in enumerate(rkeys):
            node = nodes.get_node_from_slot(key_slot(rkey))
            group = groups.get(node.name)
            if group is None:
                endpoint = self._endpoints.get(node.name)
                if endpoint is None:
                    endpoint = Endpoint.of(node.connection_class, node.connection_kwargs)
                    self._endpoints[node.name] = endpoint
                group = groups[node.name] = (endpoint, [])
            group[1].append(position)
        return list(groups.values())

    async def _topology(self) -> Any:
        """The cluster client's slot map, fetched first if it has none, refreshed first
        after a redirect."""
        client = self._client
        if self._stale:
            self._stale = False
            await client.nodes_manager.initialize()
        elif not client.nodes_manager.slots_cache:
            await client.initialize()
        return client.nodes_manager

    # -- connections ----------------------------------------------------------------------

    async def _on(self, endpoint: Endpoint, work: Callable[[WireStream], Awaitable[T]]) -> T:
        """Run ``work`` on a connection to ``endpoint``: an idle one, or a new one."""
        stream = self._take(endpoint) or await open_stream(endpoint)
        self._in_use += 1
        try:
            result = await work(stream)
        except BaseException:
            stream.abort()
            raise
        finally:
            self._in_use -= 1
        idle = self._idle.setdefault(endpoint.name, [])
        if self._closed or not stream.reusable or len(idle) >= MAX_IDLE:
            stream.close()
        else:
            stream.drop_spare()
            idle.append(stream)
        return result

    def _take(self, endpoint: Endpoint) -> WireStream | None:
        idle = self._idle.get(endpoint.name)
        while idle:
            stream = idle.pop()
            if stream.reusable:
                return stream
            stream.abort()
        return None
