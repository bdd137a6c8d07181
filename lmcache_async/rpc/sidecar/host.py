"""The sidecar's one engine: opened for the first namespace a client asks for, entered and
left in one task of its own, closed at shutdown.

A :class:`CacheEngine` is an async context manager whose enter and exit must run in the
same task, while the HELLO that opens it runs in a request's task: :class:`EngineHost`
hands the opening to its host task (:meth:`EngineHost.run`) and waits for the outcome.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio

from lmcache_async.engine import CacheEngine
from lmcache_async.errors import EngineClosedError, InvalidInputError
from lmcache_async.logging import get_logger
from lmcache_async.rpc.events import EventPublisher, engine_event_source
from lmcache_async.rpc.sidecar.settings import SidecarNamespace, SidecarSettings

__all__ = ["EngineHost"]

log = get_logger(__name__)


@dataclass(eq=False, slots=True)
class _Opening:
    """A request to the engine host task: open the engine for ``namespace``."""

    namespace: SidecarNamespace
    done: anyio.Event = field(default_factory=anyio.Event)
    error: BaseException | None = None


class EngineHost:
    """Holds the sidecar's engine (None until a namespace is fixed) and the host arena's
    buffer (the shared-memory segment) it is opened on.

    ``engine`` is read by every request handler (a plain attribute: the reader callback
    reads it for every quick answer).
    """

    def __init__(self, settings: SidecarSettings, buffer: memoryview | None) -> None:
        self._settings = settings
        self._buffer: memoryview | None = buffer
        self.engine: CacheEngine | None = None
        self.namespace: SidecarNamespace | None = None
        self._open_lock = anyio.Lock()
        self._openings_send, self._openings = anyio.create_memory_object_stream[_Opening](1)
        self._close_engine = anyio.Event()
        self._engine_closed = anyio.Event()

    @property
    def settings(self) -> SidecarSettings:
        """What the sidecar serves and how it runs (its limits, its engine's config)."""
        return self._settings

    def need_engine(self) -> CacheEngine:
        """The open engine.

        Raises:
            EngineClosedError: none is open (yet, or any more).
        """
        engine = self.engine
        if engine is None:
            raise EngineClosedError("the sidecar's engine is closed")
        return engine

    def need_buffer(self) -> memoryview:
        """The shared-memory arena's buffer.

        Raises:
            EngineClosedError: it was released (the sidecar is shutting down).
        """
        if self._buffer is None:
            raise EngineClosedError("the sidecar's shared memory is released")
        return self._buffer

    def release_buffer(self) -> None:
        """Drop the reference to the arena's buffer, so the segment can be closed."""
        self._buffer = None

    async def open(self, namespace: SidecarNamespace) -> CacheEngine:
        """The engine for ``namespace``, opened by the first caller.

        Raises:
            InvalidInputError: another namespace is served (the message names the
                differences), or the engine cannot open with these settings (ConfigError).
        """
        async with self._open_lock:
            if self.engine is None:
                opening = _Opening(namespace)
                await self._openings_send.send(opening)
                await opening.done.wait()
                if opening.error is not None:
                    raise opening.error
            assert self.engine is not None and self.namespace is not None
            why = self.namespace.mismatch(namespace)
            if why is not None:
                raise InvalidInputError(f"namespace mismatch: this sidecar cannot serve {why}")
            return self.engine

    async def run(
        self,
        *,
        publisher: EventPublisher | None,
        before_close: Callable[[], Awaitable[None]],
    ) -> None:
        """Open the engine when asked (:meth:`open`) and keep it open until :meth:`close`;
        the engine is entered and left in this one task. Its KV events go to
        ``publisher`` while it is open; ``before_close`` runs just before it closes (the
        sessions end then, releasing their pins on the engine)."""
        try:
            async with self._openings:
                async for opening in self._openings:
                    ns = opening.namespace
                    try:
                        async with CacheEngine.open(
                            self._settings.config,
                            ns.layout,
                            model_name=ns.model_name,
                            revision=ns.revision,
                            tenant=ns.tenant,
                            pool_buffer=self._buffer,
                        ) as engine:
                            self.engine, self.namespace = engine, ns
                            opening.done.set()
                            log.info(
                                "sidecar_namespace_fixed",
                                model=ns.model_name,
                                layout=ns.layout.fingerprint,
                            )
                            await self._serve(engine, publisher)
                            await before_close()
                        return
                    except Exception as exc:
                        if opening.done.is_set():
                            raise
                        log.warning("sidecar_engine_open_failed", error=str(exc))
                        # Without its frames: they hold the half-built engine's arena view,
                        # which would keep the segment from being closed.
                        opening.error = exc.with_traceback(None)
                        opening.done.set()
                    finally:
                        self.engine = None
        finally:
            self._engine_closed.set()

    async def _serve(self, engine: CacheEngine, publisher: EventPublisher | None) -> None:
        """Publish the engine's KV events (with a publisher) until the engine is to close."""
        async with anyio.create_task_group() as task_group:
            if publisher is not None:
                source = engine_event_source(engine)
                task_group.start_soon(publisher.publish_from, source, name="sidecar-events")
            await self._close_engine.wait()
            task_group.cancel_scope.cancel()

    async def close(self) -> None:
        """End every session and close the engine (flushing queued tier writes)."""
        self._close_engine.set()
        self._openings_send.close()
        await self._engine_closed.wait()
