"""A client's administration calls: CLEAR, ERASE, FREEZE, HOT_CACHE, STATS and PING.

Each is a miss (logged) when the sidecar cannot be reached: 0 chunks cleared, False for a
switch or a ping, no engine or server part in the stats. ERASE is not: an erasure that did
not happen raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmcache_async.errors import (
    InvalidInputError,
    ProtocolError,
    TierUnavailableError,
)
from lmcache_async.logging import get_logger
from lmcache_async.rpc.client.connection import Connection
from lmcache_async.rpc.client.welcome import check_tiers
from lmcache_async.rpc.client.wire import Unavailable, count
from lmcache_async.rpc.erase import erase_result
from lmcache_async.rpc.protocol import Message, MessageType, put_tenant

__all__ = ["AdminCalls"]

log = get_logger(__name__)


class AdminCalls:
    """The administration requests over ``conn``."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    async def _admin(self, msg_type: MessageType, header: dict[str, Any]) -> Message | None:
        conn = self._conn
        link = await conn.usable()
        if link is None:
            log.warning("sidecar_unreachable", request=msg_type.name, url=conn.url)
            return None
        try:
            return await conn.ask(link, msg_type, header)
        except (Unavailable, ProtocolError) as exc:
            log.warning("sidecar_request_failed", request=msg_type.name, error=str(exc))
            return None

    async def clear(self, locations: Sequence[str] | None) -> int:
        """As :meth:`RemoteCacheEngine.clear`."""
        self._conn.check_open()
        names = check_tiers(self._conn.welcome, locations, "locations")
        reply = await self._admin(MessageType.CLEAR, {"locations": names})
        return 0 if reply is None else count(reply, "chunks")

    async def erase(self, tenant: str | None) -> dict[str, int]:
        """As :meth:`RemoteCacheEngine.erase`.

        Raises:
            InvalidInputError: ``tenant`` is not None or a valid tenant name, or the
                sidecar refused it.
            TierUnavailableError: the sidecar could not be reached or did not answer:
                nothing is known to be erased.
            EraseIncompleteError: the sidecar could not erase some tier.
            EngineClosedError: the client is closed.
        """
        conn = self._conn
        conn.check_open()
        header: dict[str, Any] = {}
        put_tenant(header, tenant)
        link = await conn.usable()
        if link is None:
            raise TierUnavailableError(f"the sidecar at {conn.url} is unreachable: nothing erased")
        try:
            reply = await conn.ask(link, MessageType.ERASE, header)
        except Unavailable as exc:
            raise TierUnavailableError(
                f"ERASE to the sidecar at {conn.url} failed ({exc}): the erasure may not be done"
            ) from None
        return erase_result(reply.header)

    async def switch(self, msg_type: MessageType, enabled: bool) -> bool:
        """FREEZE or HOT_CACHE: whether the sidecar could be reached.

        Raises:
            InvalidInputError: ``enabled`` is not a bool.
            EngineClosedError: the client is closed.
        """
        self._conn.check_open()
        if not isinstance(enabled, bool):
            raise InvalidInputError(f"enabled must be a bool, got {type(enabled).__name__}")
        return await self._admin(msg_type, {"enabled": enabled}) is not None

    async def stats(self) -> dict[str, Any]:
        """As :meth:`RemoteCacheEngine.stats`."""
        conn = self._conn
        conn.check_open()
        reply = await self._admin(MessageType.STATS, {})
        counters = conn.counters
        client = {
            "connected": conn.link is not None,
            "requests": counters.requests,
            "unavailable": counters.unavailable,
            "timeouts": counters.timeouts,
            "reconnects": counters.reconnects,
            "refused": counters.refused,
            "shared_memory": conn.link is not None and conn.link.segment is not None,
            "stream": conn.link is not None and conn.link.stream,
        }
        if reply is None:
            return {"engine": None, "server": None, "client": client}
        return {
            "engine": reply.header.get("stats"),
            "server": reply.header.get("server"),
            "client": client,
        }

    async def ping(self) -> bool:
        """As :meth:`RemoteCacheEngine.ping`."""
        conn = self._conn
        link = await conn.usable()
        if link is None:
            return False
        try:
            await conn.ask(link, MessageType.PING, None)
        except (Unavailable, ProtocolError):
            return False
        return True
