"""The synchronous facade: a cache engine for callers that are not async, running on an
event-loop thread of its own.

:meth:`SyncCacheEngine.open` runs an embedded :class:`~lmcache_async.engine.CacheEngine`;
:meth:`SyncCacheEngine.connect` runs a :class:`~lmcache_async.rpc.client.RemoteCacheEngine`,
the client of a sidecar (``lmcache-async serve``). Both offer the same blocking methods, and
each call can be bounded by ``call_timeout`` so a stuck engine or sidecar costs the caller a
bounded wait, never a hang. Layerwise transfers (:meth:`SyncCacheEngine.store_layer`,
:meth:`SyncCacheEngine.retrieve_layer`) are stepped from the caller's thread through
:class:`LayerSteps`.

The engine's thread has a current CUDA stream of its own: a store or retrieve of CUDA
caches is ordered against the caller's, taken on the caller's thread when it calls (unless
it names one with ``stream=``) and handed to the engine.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import AsyncGenerator, Callable, Hashable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

import anyio
import anyio.from_thread
import torch

from lmcache_async.config import EngineConfig
from lmcache_async.engine import CacheEngine
from lmcache_async.engine.client import Promise
from lmcache_async.errors import EngineClosedError, InvalidInputError, TierUnavailableError
from lmcache_async.events import KVEvent
from lmcache_async.keys.tokens import Tokens
from lmcache_async.layouts import KVLayout
from lmcache_async.logging import get_logger
from lmcache_async.stats import EngineStats
from lmcache_async.sync.calls import (
    SidecarLookups,
    awaited,
    bounded,
    call_name,
    check_timeout,
    with_stream,
)

if TYPE_CHECKING:  # rpc sits above the engine: imported when a sidecar is used
    from lmcache_async.rpc.client import RemoteCacheEngine

__all__ = ["DEFAULT_SIDECAR_TIMEOUT", "LayerSteps", "SyncCacheEngine"]

log = get_logger(__name__)

T = TypeVar("T")

DEFAULT_SIDECAR_TIMEOUT: Final = 5.0
"""Seconds each request to a sidecar may take (:meth:`SyncCacheEngine.connect`)."""

_SIDECAR_CALL_ROUND_TRIPS: Final = 3
"""A sidecar store or retrieve is at most this many bounded steps (request, copy, release):
the default ``call_timeout`` of :meth:`SyncCacheEngine.connect` is that many timeouts."""

_STUCK_LOOP_GRACE: Final = 1.0
"""Seconds the caller's thread waits beyond ``call_timeout`` for the engine's thread to
give up a call itself (and return the memory it touched) before giving up on it."""


class SyncCacheEngine:
    """A cache engine for callers without an event loop: it runs on a thread of its own.

    ``SyncCacheEngine.open(config, layout, model_name=...)`` starts the thread and an
    embedded engine; ``SyncCacheEngine.connect(url, layout, model_name=...)`` starts the
    thread and a client of the sidecar at ``url``. :meth:`close` (or leaving a ``with``
    block) stops both. Methods may be called from any thread.

    With ``call_timeout`` every call returns or raises within about that many seconds:
    a call the engine does not finish in time is cancelled on the engine's thread (which
    returns the memory it took and waits for a copy under way) and raises
    TierUnavailableError.
    """

    def __init__(
        self,
        portal_cm: Any,
        portal: anyio.from_thread.BlockingPortal,
        engine_cm: Any,
        engine: CacheEngine | RemoteCacheEngine,
        *,
        call_timeout: float | None = None,
    ) -> None:
        self._portal_cm = portal_cm
        self._portal = portal
        self._engine_cm = engine_cm
        self._engine = engine
        self._call_timeout = call_timeout
        self._closed = False
        self._lookup_servers: list[Any] = []
        self._steps: set[LayerSteps[Any]] = set()
        self._steps_lock = threading.Lock()

    @classmethod
    def open(
        cls,
        config: EngineConfig,
        layout: KVLayout,
        *,
        model_name: str,
        revision: str | None = None,
        tenant: str | None = None,
        call_timeout: float | None = None,
    ) -> SyncCacheEngine:
        """Start an embedded engine on a new event-loop thread.

        ``call_timeout``: seconds any one call may take (None: only the engine's own
        ``store_timeout`` / ``retrieve_timeout`` bound them).

        Raises:
            InvalidInputError: a bad ``call_timeout``; otherwise what CacheEngine.open
                raises.
        """
        check_timeout("call_timeout", call_timeout, optional=True)
        context = functools.partial(
            CacheEngine.open,
            config,
            layout,
            model_name=model_name,
            revision=revision,
            tenant=tenant,
        )
        return cls._start(context, call_timeout)

    @classmethod
    def connect(
        cls,
        url: str,
        layout: KVLayout,
        *,
        model_name: str,
        revision: str | None = None,
        tenant: str | None = None,
        timeout: float = DEFAULT_SIDECAR_TIMEOUT,
        call_timeout: float | None = None,
        require_server: bool = False,
        shared_memory: bool | None = None,
        server_public_key: bytes | str | None = None,
        client_certificate: str | None = None,
        name: str | None = None,
    ) -> SyncCacheEngine:
        """Start a client of the sidecar at ``url`` on a new event-loop thread.

        ``timeout`` bounds each request to the sidecar; ``call_timeout`` (default: three
        timeouts) bounds each call of this facade. With ``require_server=False`` (the
        default) a sidecar that does not answer is not an error: calls are misses (store
        0, retrieve all False, lookup 0) until it answers. The other arguments are those
        of :meth:`RemoteCacheEngine.connect <lmcache_async.RemoteCacheEngine.connect>`.

        Raises:
            InvalidInputError: a bad argument, or the sidecar serves another namespace.
            ProtocolError: the sidecar speaks another protocol version.
            TierUnavailableError: with ``require_server``, no answer within ``timeout``.
        """
        from lmcache_async.rpc.client import RemoteCacheEngine  # noqa: PLC0415

        check_timeout("timeout", timeout)
        check_timeout("call_timeout", call_timeout, optional=True)
        if call_timeout is None:
            call_timeout = _SIDECAR_CALL_ROUND_TRIPS * float(timeout)
        context = functools.partial(
            RemoteCacheEngine.connect,
            url,
            layout,
            model_name=model_name,
            revision=revision,
            tenant=tenant,
            timeout=timeout,
            server_public_key=server_public_key,
            client_certificate=client_certificate,
            shared_memory=shared_memory,
            require_server=require_server,
            name=name,
        )
        return cls._start(context, call_timeout)

    @classmethod
    def _start(cls, context: Callable[[], Any], call_timeout: float | None) -> SyncCacheEngine:
        """Start the thread, build the engine's context manager there (it may need the
        event loop) and enter it."""
        portal_cm = anyio.from_thread.start_blocking_portal("asyncio")
        portal = portal_cm.__enter__()
        try:
            engine_cm = portal.wrap_async_context_manager(portal.call(context))
            engine = engine_cm.__enter__()
        except BaseException as exc:
            portal_cm.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return cls(portal_cm, portal, engine_cm, engine, call_timeout=call_timeout)

    @property
    def engine(self) -> CacheEngine | RemoteCacheEngine:
        """The engine on the thread: a CacheEngine, or a RemoteCacheEngine (sidecar)."""
        return self._engine

    @property
    def is_remote(self) -> bool:
        """Whether this facade talks to a sidecar (:meth:`connect`)."""
        return not isinstance(self._engine, CacheEngine)

    @property
    def call_timeout(self) -> float | None:
        return self._call_timeout

    @property
    def chunk_size(self) -> int | None:
        """Tokens per chunk: the engine's, or the sidecar's (None until it has answered)."""
        engine = self._engine
        if isinstance(engine, CacheEngine):
            return engine.config.chunk_size
        return engine.chunk_size

    def _embedded(self, what: str) -> CacheEngine:
        engine = self._engine
        if not isinstance(engine, CacheEngine):
            raise InvalidInputError(f"{what} is not offered over the sidecar")
        return engine

    # -- calls into the engine's thread ----------------------------------------------------

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` (awaited when it returns an awaitable) on the
        engine's thread; bounded by ``call_timeout`` when one is set.

        Raises:
            EngineClosedError: after :meth:`close`.
            TierUnavailableError: the call did not finish within ``call_timeout``.
        """
        if self._closed:
            raise EngineClosedError("the cache engine is closed")
        call = functools.partial(fn, *args, **kwargs)
        limit = self._call_timeout
        if limit is None:
            return self._portal.call(awaited, call)
        future = self._portal.start_task_soon(bounded, call, limit)
        try:
            return future.result(timeout=limit + _STUCK_LOOP_GRACE)
        except concurrent.futures.TimeoutError:
            future.cancel()
            log.error("sync_engine_call_stuck", call=call_name(fn), seconds=limit)
            raise TierUnavailableError(
                f"the cache engine's thread did not finish {call_name(fn)} within {limit} s"
            ) from None

    def store(self, tokens: Tokens | None = None, **kwargs: Any) -> int:
        """As ``engine.store``; returns the tokens stored. ``stream`` defaults to this
        thread's current stream of the caches' device."""
        result: int = self._call(self._engine.store, tokens, **with_stream(kwargs))
        return result

    def retrieve(self, tokens: Tokens | None = None, **kwargs: Any) -> torch.Tensor:
        """As ``engine.retrieve``; returns the bool CPU mask of the tokens loaded.
        ``stream`` defaults to this thread's current stream of the caches' device."""
        result: torch.Tensor = self._call(self._engine.retrieve, tokens, **with_stream(kwargs))
        return result

    def retrieve_soon(
        self, tokens: Tokens | None = None, *, timeout: float, **kwargs: Any
    ) -> concurrent.futures.Future[torch.Tensor]:
        """As :meth:`retrieve`, started and returned at once: the future is the mask, or
        raises TierUnavailableError once the retrieve was cancelled at ``timeout`` seconds
        (a copy under way finished first): once it is done, nothing more is written.
        Raises InvalidInputError for a bad ``timeout``, EngineClosedError after close."""
        check_timeout("timeout", timeout)
        if self._closed:
            raise EngineClosedError("the cache engine is closed")
        call = functools.partial(self._engine.retrieve, tokens, **with_stream(kwargs))
        future: concurrent.futures.Future[torch.Tensor]
        future = self._portal.start_task_soon(bounded, call, timeout)
        return future

    def lookup(self, tokens: Tokens | None = None, **kwargs: Any) -> int:
        """As ``engine.lookup``; returns the cached prefix tokens."""
        result: int = self._call(self._engine.lookup, tokens, **kwargs)
        return result

    def promise(self, tokens: Tokens | None = None, **kwargs: Any) -> Promise:
        """As ``engine.promise``: the prompt tokens verified in host memory for a load under
        ``lookup_id``, and whether to ask again."""
        result: Promise = self._call(self._engine.promise, tokens, **kwargs)
        return result

    def lookup_unpin(self, lookup_id: Hashable) -> None:
        self._call(self._engine.lookup_unpin, lookup_id)

    def clear(self) -> int:
        result: int = self._call(self._engine.clear)
        return result

    def erase(self, tenant: str | None = None) -> dict[str, int]:
        """As ``engine.erase``: every chunk of ``tenant`` removed; the chunks per tier."""
        result: dict[str, int] = self._call(self._engine.erase, tenant)
        return result

    def freeze(self, enabled: bool) -> None:
        self._call(self._engine.freeze, enabled)

    def set_hot_cache(self, enabled: bool) -> None:
        self._call(self._engine.set_hot_cache, enabled)

    def take_events(self) -> list[KVEvent]:
        """The embedded engine's KV events. Raises InvalidInputError for a sidecar (its
        events are published on the socket ``lmcache-async serve --events`` names)."""
        engine = self._embedded("take_events (KV events)")
        result: list[KVEvent] = self._call(engine.take_events)
        return result

    def is_healthy(self) -> bool:
        return not self._closed and bool(self._call(self._engine.is_healthy))

    def stats(self) -> EngineStats:
        """The embedded engine's stats. Raises InvalidInputError for a sidecar (use
        :meth:`sidecar_stats`)."""
        engine = self._embedded("stats() (use sidecar_stats())")
        result: EngineStats = self._call(engine.stats)
        return result

    def sidecar_stats(self) -> dict[str, Any]:
        """The sidecar's stats as plain data (``"engine"``, ``"server"``, ``"client"``; see
        :meth:`RemoteCacheEngine.stats <lmcache_async.RemoteCacheEngine.stats>`). Raises
        InvalidInputError for an embedded engine (use :meth:`stats`)."""
        engine = self._engine
        if isinstance(engine, CacheEngine):
            raise InvalidInputError("sidecar_stats() needs a sidecar; use stats()")
        result: dict[str, Any] = self._call(engine.stats)
        return result

    # -- layerwise --------------------------------------------------------------------------

    def store_layer(self, tokens: Tokens | None = None, **kwargs: Any) -> LayerSteps[int | None]:
        """As :meth:`CacheEngine.store_layer <lmcache_async.CacheEngine.store_layer>`, stepped
        from this thread: ``num_layers + 1`` steps, the last returning the tokens stored.
        ``stream`` defaults to this thread's current stream of the caches' device.

        Raises:
            InvalidInputError: bad input, or a sidecar (layerwise is embedded only).
            EngineClosedError: after :meth:`close`.
        """
        engine = self._embedded("store_layer (layerwise transfer)")
        iterator = self._call(engine.store_layer, tokens, **with_stream(kwargs))
        return self._track(LayerSteps(self, iterator, engine.layout.num_layers + 1))

    def retrieve_layer(
        self, tokens: Tokens | None = None, **kwargs: Any
    ) -> LayerSteps[torch.Tensor | None]:
        """As :meth:`CacheEngine.retrieve_layer <lmcache_async.CacheEngine.retrieve_layer>`,
        stepped from this thread: ``num_layers + 1`` steps, step *i + 1* returning once
        layer *i* is loaded, the last returning the bool CPU mask of the tokens loaded.
        ``stream`` defaults to this thread's current stream of the caches' device.

        Raises:
            InvalidInputError: bad input, or a sidecar (layerwise is embedded only).
            EngineClosedError: after :meth:`close`.
        """
        engine = self._embedded("retrieve_layer (layerwise transfer)")
        iterator = self._call(engine.retrieve_layer, tokens, **with_stream(kwargs))
        return self._track(LayerSteps(self, iterator, engine.layout.num_layers + 1))

    def _track(self, steps: LayerSteps[T]) -> LayerSteps[T]:
        with self._steps_lock:
            self._steps.add(steps)
        return steps

    def _untrack(self, steps: LayerSteps[Any]) -> None:
        with self._steps_lock:
            self._steps.discard(steps)

    # -- lookups for a scheduler ------------------------------------------------------------

    def serve_lookups(
        self,
        instance_id: str,
        rank: int,
        socket_dir: str | None = None,
        *,
        prefill_speed: Callable[[], float | None] | None = None,
    ) -> str:
        """Answer a scheduler's lookups for this engine until :meth:`close`.

        Starts a :class:`~lmcache_async.rpc.lookup.LookupServer` on the engine's thread and
        returns its endpoint. For a sidecar, each lookup is asked of the sidecar (bounded
        by the client's timeout; a sidecar that does not answer is a miss).
        ``prefill_speed`` (called on the engine's thread, so it must not block) gives each
        promise the serving engine's prefill tokens/s (None: unknown). Raises
        InvalidInputError for a bad argument or an endpoint that cannot be bound,
        EngineClosedError after close.
        """
        # rpc sits above the engine: imported here, so the engine never imports it on load.
        from lmcache_async.rpc.lookup import LookupServer  # noqa: PLC0415

        if self._closed:
            raise EngineClosedError("the cache engine is closed")
        answering: Any = self._engine
        if not isinstance(answering, CacheEngine):
            answering = SidecarLookups(answering)
        context = self._portal.wrap_async_context_manager(
            LookupServer.serve(
                answering,
                instance_id=instance_id,
                rank=rank,
                socket_dir=socket_dir,
                prefill_speed=prefill_speed,
            )
        )
        server = context.__enter__()
        self._lookup_servers.append(context)
        return server.endpoint

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Close open layerwise steps, the lookup servers, the engine and its thread;
        idempotent."""
        if self._closed:
            return
        with self._steps_lock:
            open_steps, self._steps = list(self._steps), set()
        for steps in open_steps:
            with contextlib.suppress(Exception):
                steps.close()
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


class LayerSteps(Generic[T]):
    """A layerwise store or retrieve of a :class:`SyncCacheEngine`, stepped from the
    caller's thread: each :meth:`step` is one ``anext()`` of the engine's async iterator,
    run on the engine's thread and bounded like every call of the facade.

    After a step raises (a failure, a timeout) the iterator is finished: the engine has
    returned its memory. :meth:`close` ends it early (nothing is stored; references are
    returned); leaving a ``with`` block closes it too.
    """

    def __init__(
        self, owner: SyncCacheEngine, iterator: AsyncGenerator[T, None], total: int
    ) -> None:
        self._owner = owner
        self._iterator = iterator
        self._total = total
        self._taken = 0
        self._done = False
        self._last: T | None = None

    @property
    def total(self) -> int:
        """Steps of the whole transfer (``num_layers + 1``)."""
        return self._total

    @property
    def taken(self) -> int:
        """Steps taken so far."""
        return self._taken

    @property
    def done(self) -> bool:
        """Whether no step is left (every step taken, a step failed, or closed)."""
        return self._done

    def step(self) -> T:
        """Take the next step; returns what it yields (the last step: the result).

        Raises:
            InvalidInputError: no step is left.
            EngineClosedError: the engine was closed.
            TierUnavailableError: the step did not finish within the call timeout.
            InvalidInputError: invalid tokens (found at the first step).
        """
        if self._done:
            raise InvalidInputError("this layerwise transfer has no step left")
        try:
            value: T = self._owner._call(anext, self._iterator)
        except StopAsyncIteration:
            self._finish()
            raise InvalidInputError("this layerwise transfer has no step left") from None
        except BaseException:
            self._finish()
            raise
        self._taken += 1
        self._last = value
        if self._taken >= self._total:
            self._finish()
        return value

    def finish(self) -> T | None:
        """Take every step left; returns the last step's value (the result), or the last
        value seen when none was left. Raises as :meth:`step`."""
        while not self._done:
            self.step()
        return self._last

    def close(self) -> None:
        """End the transfer early, returning its memory on the engine's thread (bounded);
        idempotent."""
        if self._done:
            return
        self._finish()
        if not self._owner._closed:
            self._owner._call(self._iterator.aclose)

    def _finish(self) -> None:
        self._done = True
        self._owner._untrack(self)

    def __enter__(self) -> LayerSteps[T]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
