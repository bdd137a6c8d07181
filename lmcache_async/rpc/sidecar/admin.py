"""CLEAR, ERASE, FREEZE, HOT_CACHE, STATS, HEALTH and SHUTDOWN: the sidecar's
administration.

Only an admin may clear, erase, freeze, hot-cache or shut down, and only an admin reads
per-tenant figures: a client certificate's STATS comes without them
(:meth:`AdminHandlers.on_client_stats`). None of them needs a session:
:class:`~lmcache_async.rpc.admin.AdminClient` (behind ``lmcache-async ctl`` and
``lmcache-async stats``) sends them over a DEALER socket that never says HELLO. ERASE names its
tenant in ``"tenant"`` (absent: the engine's own) and answers
``{"removed": {tier: chunks}, "failed": {tier: why}}``: a tier that could not be erased
is in ``failed``, not an ERROR reply, so the caller still learns what the others removed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from lmcache_async.errors import EraseIncompleteError
from lmcache_async.logging import get_logger
from lmcache_async.rpc.protocol import Message, tenant_of, to_wire
from lmcache_async.rpc.sidecar.fields import flag_field, locations_field
from lmcache_async.rpc.sidecar.host import EngineHost
from lmcache_async.rpc.sidecar.routes import Reply
from lmcache_async.rpc.sidecar.sessions import Session

__all__ = ["AdminHandlers"]

log = get_logger(__name__)


class AdminHandlers:
    """The administration requests, on the engine ``host`` holds. ``status`` gives the
    server's own part of a STATS reply; SHUTDOWN sets ``stopping``."""

    def __init__(
        self,
        host: EngineHost,
        *,
        status: Callable[[], dict[str, Any]],
        stopping: anyio.Event,
    ) -> None:
        self._host = host
        self._status = status
        self._stopping = stopping

    async def on_clear(self, session: Session | None, message: Message) -> Reply:
        engine = self._host.need_engine()
        dropped = await engine.clear(locations_field(message.header, "locations"))
        return {"chunks": dropped}, ()

    async def on_erase(self, session: Session | None, message: Message) -> Reply:
        tenant = tenant_of(message.header)
        engine = self._host.need_engine()
        try:
            removed = await engine.erase(tenant)
        except EraseIncompleteError as exc:
            return {"removed": exc.removed, "failed": exc.failed}, ()
        return {"removed": removed, "failed": {}}, ()

    async def on_freeze(self, session: Session | None, message: Message) -> Reply:
        enabled = flag_field(message.header, "enabled", required=True)
        self._host.need_engine().freeze(enabled)
        return {"enabled": enabled}, ()

    async def on_hot_cache(self, session: Session | None, message: Message) -> Reply:
        enabled = flag_field(message.header, "enabled", required=True)
        self._host.need_engine().set_hot_cache(enabled)
        return {"enabled": enabled}, ()

    async def on_stats(self, session: Session | None, message: Message) -> Reply:
        engine = self._host.engine
        stats = None if engine is None else to_wire(engine.stats())
        return {"stats": stats, **self._status()}, ()

    async def on_client_stats(self, session: Session | None, message: Message) -> Reply:
        """STATS for a client certificate: every figure but the per-tenant ones."""
        header, payloads = await self.on_stats(session, message)
        return _without_tenants(header), payloads

    async def on_health(self, session: Session | None, message: Message) -> Reply:
        engine = self._host.engine
        if engine is None:
            return {"healthy": True, "tiers": {}, "engine": False}, ()
        tiers = await engine.check_health()  # probe now: the caller asks for the state now
        return {"healthy": engine.is_healthy(), "tiers": to_wire(tiers)}, ()

    async def on_shutdown(self, session: Session | None, message: Message) -> Reply:
        log.info("sidecar_shutdown_requested")
        self._stopping.set()
        return {}, ()


def _without_tenants(value: Any) -> Any:
    """``value`` (a STATS reply's wire form) with every ``"tenants"`` entry left out."""
    if isinstance(value, dict):
        return {k: _without_tenants(v) for k, v in value.items() if k != "tenants"}
    if isinstance(value, list):
        return [_without_tenants(v) for v in value]
    return value
