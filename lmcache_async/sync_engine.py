"""The synchronous facade: a :class:`~lmcache_async.engine.CacheEngine` for callers that
are not async, running on an event-loop thread of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from types import TracebackType
from typing import Any

import anyio
import anyio.from_thread
import torch

from .config import EngineConfig
from .engine import CacheEngine, Tokens
from .errors import EngineClosedError
from .events import KVEvent
from .layouts import KVLayout
from .stats import EngineStats

__all__ = ["SyncCacheEngine"]


class SyncCacheEngine:
    """The same engine for callers without an event loop: it runs on a thread of its own.

    ``SyncCacheEngine.open(config, layout, model_name=...)`` starts the thread and the
    engine; :meth:`close` (or leaving a ``with`` block) stops both. Methods may be called
    from any thread.
    """

    def __init__(
        self,
        portal_cm: Any,
        portal: anyio.from_thread.BlockingPortal,
        engine_cm: Any,
        engine: CacheEngine,
    ) -> None:
        self._portal_cm = portal_cm
        self._portal = portal
        self._engine_cm = engine_cm
        self._engine = engine
        self._closed = False
        self._lookup_servers: list[Any] = []

    @classmethod
    def open(
        cls,
        config: EngineConfig,
        layout: KVLayout,
        *,
        model_name: str,
        revision: str | None = None,
        tenant: str | None = None,
    ) -> SyncCacheEngine:
        """Start an engine on a new event-loop thread. Raises what CacheEngine.open raises."""
        context = CacheEngine.open(
            config, layout, model_name=model_name, revision=revision, tenant=tenant
        )
        portal_cm = anyio.from_thread.start_blocking_portal("asyncio")
        portal = portal_cm.__enter__()
        try:
            engine_cm = portal.wrap_async_context_manager(context)
            engine = engine_cm.__enter__()
        except BaseException as exc:
            portal_cm.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return cls(portal_cm, portal, engine_cm, engine)

    @property
    def engine(self) -> CacheEngine:
        return self._engine

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise EngineClosedError("the cache engine is closed")
        return self._portal.call(functools.partial(fn, *args, **kwargs))

    def store(self, tokens: Tokens | None = None, **kwargs: Any) -> int:
        result: int = self._call(self._engine.store, tokens, **kwargs)
        return result

    def retrieve(self, tokens: Tokens | None = None, **kwargs: Any) -> torch.Tensor:
        result: torch.Tensor = self._call(self._engine.retrieve, tokens, **kwargs)
        return result

    def lookup(self, tokens: Tokens | None = None, **kwargs: Any) -> int:
        result: int = self._call(self._engine.lookup, tokens, **kwargs)
        return result

    def lookup_unpin(self, lookup_id: Hashable) -> None:
        self._call(self._engine.lookup_unpin, lookup_id)

    def clear(self) -> int:
        result: int = self._call(self._engine.clear)
        return result

    def freeze(self, enabled: bool) -> None:
        self._call(self._engine.freeze, enabled)

    def set_hot_cache(self, enabled: bool) -> None:
        self._call(self._engine.set_hot_cache, enabled)

    def take_events(self) -> list[KVEvent]:
        result: list[KVEvent] = self._call(self._engine.take_events)
        return result

    def is_healthy(self) -> bool:
        return not self._closed and bool(self._call(self._engine.is_healthy))

    def stats(self) -> EngineStats:
        result: EngineStats = self._call(self._engine.stats)
        return result

    def serve_lookups(self, instance_id: str, rank: int, socket_dir: str | None = None) -> str:
        """Answer a scheduler's lookups for this engine until :meth:`close`.

        Starts a :class:`~lmcache_async.rpc.lookup.LookupServer` on the engine's thread and
        returns its endpoint. Raises InvalidInputError for a bad argument or an endpoint
        that cannot be bound, EngineClosedError after close.
        """
        # rpc sits above the engine: imported here, so the engine never imports it on load.
        from .rpc.lookup import LookupServer  # noqa: PLC0415

        if self._closed:
            raise EngineClosedError("the cache engine is closed")
        context = self._portal.wrap_async_context_manager(
            LookupServer.serve(
                self._engine, instance_id=instance_id, rank=rank, socket_dir=socket_dir
            )
        )
        server = context.__enter__()
        self._lookup_servers.append(context)
        return server.endpoint

    def close(self) -> None:
        """Stop the lookup servers, the engine and its thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            while self._lookup_servers:
                self._lookup_servers.pop().__exit__(None, None, None)
            self._engine_cm.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> SyncCacheEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
