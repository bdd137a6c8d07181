"""The cache engine: the public async API over the request core, pipelines and tiers.

``CacheEngine.open(config, layout, model_name=...)`` is an async context manager that builds
the memory pool, the tiers, the request core and both pipelines, and tears all of them down
on exit. :class:`~lmcache_async.sync.engine.SyncCacheEngine` runs the same engine on an
event-loop thread of its own for callers that are not async. The engine is wiring: its
parts, each built here with its dependencies passed in, are the key input
(:mod:`.requests`), the request core (:mod:`lmcache_async.core`), the run policy
(:mod:`.execute`), lookups and pins (:mod:`.lookups`) and the tiers (:mod:`.tiers`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Sequence
from types import TracebackType

import anyio
import anyio.to_thread
import numpy as np
import torch
from anyio.abc import TaskGroup

from lmcache_async.keys.chunks import ChunkHasher, ChunkKey, ChunkSpan, Namespace
from lmcache_async.keys.tokens import Tokens
from lmcache_async.logging import get_logger, set_library_log_level
from lmcache_async.transfer.cuda import caller_stream

from ..backends.codec import Codec
from ..backends.record import RecordSpec
from ..config import EngineConfig
from ..core import RequestCore
from ..errors import InvalidInputError
from ..health import HealthMonitor
from ..layouts import KVLayout
from ..pipelines.common import Request
from ..pipelines.layerwise import RetrieveLayers, StoreLayers
from ..pipelines.retrieve import RetrieveRequest
from ..pipelines.store import StoreRequest
from .controls import TierControls
from .parts import build_parts
from .queries import Queries
from .tiers import open_slow_tiers, record_spec

__all__ = ["CacheEngine"]

log = get_logger(__name__)


class CacheEngine(Queries, TierControls):
    """Stores and retrieves the KV cache of token prefixes for one model and KV layout.

    Create it with :meth:`open`. Methods are called from the event loop that opened it.
    Input errors raise :class:`~lmcache_async.errors.InvalidInputError` before anything is
    stored; after :meth:`aclose` every method but :meth:`stats` (a snapshot of what the
    engine left) raises :class:`~lmcache_async.errors.EngineClosedError`.
    """

    def __init__(
        self,
        config: EngineConfig,
        layout: KVLayout,
        *,
        model_name: str,
        revision: str | None = None,
        tenant: str | None = None,
        pool_buffer: memoryview | None = None,
    ) -> None:
        self.config = config
        self.layout = layout
        self.namespace = Namespace(
            model_name=model_name,
            layout_fingerprint=layout.fingerprint,
            revision=revision,
            tenant_salt=tenant,
        )
        super().__init__(build_parts(config, layout, self.namespace, pool_buffer))

    # -- lifecycle ------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        config: EngineConfig,
        layout: KVLayout,
        *,
        model_name: str,
        revision: str | None = None,
        tenant: str | None = None,
        pool_buffer: memoryview | None = None,
    ) -> _EngineContext:
        """An async context manager that yields a running engine and closes it on exit.

        ``model_name``, ``revision`` (weights fingerprint) and ``tenant`` (a salt) go into
        every chunk key with the layout's fingerprint, so caches of different models,
        weights, layouts or tenants never mix. ``pool_buffer`` (e.g. a shared-memory
        segment's ``buf``) becomes the host arena instead of ``max_local_cpu_size`` bytes
        allocated here; the caller keeps it mapped until the engine is closed.
        ``config.log_level``, when given, becomes the level of the library's own logger
        (``lmcache_async``); nothing else in the process's logging changes. Raises
        InvalidInputError for a bad argument.
        """
        if not isinstance(config, EngineConfig):
            raise InvalidInputError("config must be an EngineConfig")
        if not isinstance(layout, KVLayout):
            raise InvalidInputError("layout must be a KVLayout")
        if not isinstance(model_name, str) or not model_name:
            raise InvalidInputError("model_name must be a non-empty string")
        set_library_log_level(config.log_level)
        engine = cls(
            config,
            layout,
            model_name=model_name,
            revision=revision,
            tenant=tenant,
            pool_buffer=pool_buffer,
        )
        return _EngineContext(engine)

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        if self.config.prefault_pool:
            self._parts.pool.prefault()  # a thread: the start does not wait for it
        self._parts.transfers.start_threads()  # nor for these
        slow = await open_slow_tiers(self.config, self._parts.pool, self.record_spec())
        self._parts.manager.attach_slow_tiers(slow)
        await stack.enter_async_context(self._parts.store_pipe)
        await stack.enter_async_context(self._parts.retrieve_pipe)
        task_group: TaskGroup = await stack.enter_async_context(anyio.create_task_group())
        await task_group.start(self._parts.lookups.reap_pins, name="pin-reaper")
        self._parts.core.load.start(task_group)
        await self._parts.manager.start(task_group)
        if slow:
            self._parts.health = HealthMonitor(
                slow, interval=self.config.health_check_interval, timeout=self.config.remote_timeout
            )
            task_group.start_soon(self._watch_health, name="tier-health")
        task_group.start_soon(self._parts.probe.run, name="tier-probe")
        self._parts.started = True
        log.info(
            "engine_started",
            model=self.namespace.model_name,
            layout=self.layout.fingerprint,
            cpu_bytes=self._parts.pool.capacity_bytes,
            chunk_size=self.config.chunk_size,
            tiers=list(self._parts.manager.tier_names),
        )

    def record_spec(self, codec: Codec | None = None) -> RecordSpec:
        """How this engine's chunks are written to disk and Redis."""
        return record_spec(self.config, self.layout, codec, self._parts.cipher)

    async def _watch_health(self) -> None:
        assert self._parts.health is not None
        with self._parts.health_scope:
            await self._parts.health.run()

    async def aclose(self) -> None:
        """Finish queued work, stop the pipelines and release every byte of host memory."""
        if self._parts.closed:
            return
        self._parts.closed = True
        await self._parts.store_pipe.aclose()
        await self._parts.retrieve_pipe.aclose()
        if self._parts.started:
            with anyio.move_on_after(self.config.store_timeout, shield=True):
                await self._parts.store_pipe.wait_stopped()
                await self._parts.retrieve_pipe.wait_stopped()
        await self._parts.lookups.stop_reaping()
        self._parts.health_scope.cancel()
        await self._parts.probe.stop()  # its chunk removed before the tiers close
        # Joining the copy and bridge threads blocks: do it off the event loop, and finish
        # it even when the closing task is being cancelled.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._parts.transfers.close)
        with anyio.CancelScope(shield=True):
            await self._parts.manager.aclose(drain_timeout=self.config.store_timeout)
        pool = self._parts.pool
        pool.close(unpin=False)
        if pool.pinned:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(pool.unpin)  # cudaHostUnregister blocks
        self._parts.kv_views.forget()
        log.info("engine_closed", model=self.namespace.model_name)

    @property
    def closed(self) -> bool:
        return self._parts.closed

    # -- requests -------------------------------------------------------------------------

    async def store(
        self,
        tokens: Tokens | None = None,
        *,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        req_id: str | None = None,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        store_location: Sequence[str] | None = None,
        stream: torch.cuda.Stream | None = None,
        tenant: str | None = None,
    ) -> int:
        """Copy the KV of ``tokens`` out of ``kv_caches`` into the cache.

        ``kv_caches``: one tensor per layer in the engine's layout; ``slot_mapping``: 1-D
        integer tensor, one slot per token (``block * block_size + offset``). ``mask``
        (bool, ``F…FT…T``) stores only the chunks from its first True on. A chunk that holds a
        token with a negative slot, and every chunk after it, is not stored. Instead of
        ``tokens`` the serving engine's block ``hashes`` with their end ``offsets`` may be
        given.

        Returns the number of tokens, from the first stored chunk on, whose chunks are cached
        when the call returns. It is smaller than asked when host memory could not be had in
        time (a partial store, logged) and 0 when the engine is frozen, its hot cache is off,
        or it is unhealthy. ``store_location`` names the tiers to write (default: the
        configured ``store_location``); disk and Redis are written behind the call unless
        ``wait_for_slow_tiers`` is set. ``stream``: the CUDA stream the KV was written on
        (default: the current stream of the caches' device, now); the copies read it as
        it stands there when this is called. Ignored for caches on the CPU. ``tenant``:
        whose KV this is (default: the engine's ``tenant``); it is bound into the keys, so
        only requests of the same tenant find it. Raises InvalidInputError (nothing
        stored) for bad input.
        """
        self._check_open()
        locations = self.check_locations(store_location, "store_location")
        request, start = self._parts.keys.prepare(
            StoreRequest,
            tokens=tokens,
            kv_caches=kv_caches,
            slot_mapping=slot_mapping,
            mask=mask,
            req_id=req_id,
            hashes=hashes,
            offsets=offsets,
            tenant=tenant,
        )
        request.locations = locations
        if not self._parts.core.store.open():
            return 0
        _capture_stream(request, stream)
        skipped = request.plan.first_skipped(start)
        request.limit = request.num_tokens if skipped is None else skipped
        stored = await self._parts.runner.execute(
            self._parts.store_pipe,
            request,
            request.completion,
            self.config.store_timeout,
            inline=self._parts.runner.runs_inline(request, locations),
        )
        return request.stored_tokens() if stored is None else stored

    async def retrieve(
        self,
        tokens: Tokens | None = None,
        *,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        req_id: str | None = None,
        lookup_id: Hashable | None = None,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        retrieve_locations: Sequence[str] | None = None,
        stream: torch.cuda.Stream | None = None,
        tenant: str | None = None,
    ) -> torch.Tensor:
        """Load the cached KV of the longest cached run of chunks from the mask start on.

        Returns a bool CPU tensor of ``len(tokens)``: True exactly for the tokens whose KV
        was written into ``kv_caches``; nothing outside it is written, and tokens with a
        negative slot are never written. Chunks held only by disk or Redis are read into
        host memory (and kept in the CPU tier); ``retrieve_locations`` limits the tiers read.
        Chunks prefetched (:meth:`prefetch`) and pins held for ``lookup_id`` are used, then
        released when it finishes. With ``remove_after_retrieve`` the loaded chunks are
        removed from the cache. ``stream``: the CUDA stream the KV is read on (default: the
        current stream of the caches' device, now); the copies come after what is queued
        there when this is called, and what is queued there next comes after them.
        Ignored for caches on the CPU. ``tenant``: whose KV is asked for (as
        :meth:`store`). Raises InvalidInputError for bad input.
        """
        self._check_open()
        load = self._parts.core.load
        request: RetrieveRequest | None = None
        try:
            locations = self.check_locations(retrieve_locations, "retrieve_locations")
            request, _ = self._parts.keys.prepare(
                RetrieveRequest,
                tokens=tokens,
                kv_caches=kv_caches,
                slot_mapping=slot_mapping,
                mask=mask,
                req_id=req_id,
                hashes=hashes,
                offsets=offsets,
                tenant=tenant,
            )
            request.locations = locations
            request.lookup_id = lookup_id
            _capture_stream(request, stream)
            request.mask = torch.zeros(request.num_tokens, dtype=torch.bool)
            if not await load.begin(lookup_id):
                return request.mask
            result = await self._parts.runner.execute(
                self._parts.retrieve_pipe,
                request,
                request.completion,
                self.config.retrieve_timeout,
                inline=self._parts.runner.runs_inline(request, locations),
            )
            if result is None:
                # Timed out or failed: a snapshot, in case an abandoned copy lands later.
                return request.mask.clone()
            if self.config.remove_after_retrieve and request.loaded_tokens:
                await load.remove(_loaded_keys(request.spans, request.mask))
            return result
        finally:
            load.finish(lookup_id, request.loaded_tokens if request is not None else 0)

    # -- layerwise ------------------------------------------------------------------------

    def store_layer(
        self,
        tokens: Tokens | None = None,
        *,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        req_id: str | None = None,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        stream: torch.cuda.Stream | None = None,
        tenant: str | None = None,
    ) -> StoreLayers:
        """Store like :meth:`store`, one layer at a time: an async iterator of
        ``num_layers + 1`` steps (await one after each layer's compute, which starts that
        layer's copy, and one more at the end, which yields the tokens stored; the others
        yield None). Each chunk is stored as one ``KV_T2D`` payload per layer and counts as
        cached once every layer is. ``aclose()`` before the end stores nothing and returns
        the memory taken. ``stream``: where the layers are computed (as :meth:`store`);
        each step's copy reads what was queued there before the step. ``tenant`` as
        :meth:`store`. Raises InvalidInputError here for bad input (tokens checked off the
        loop: at the first step).
        """
        self._check_open()
        request, start = self._parts.keys.prepare(
            Request,
            tokens=tokens,
            kv_caches=kv_caches,
            slot_mapping=slot_mapping,
            mask=mask,
            req_id=req_id,
            hashes=hashes,
            offsets=offsets,
            tenant=tenant,
        )
        _capture_stream(request, stream)
        accepted = self._parts.core.store.open()
        skipped = request.plan.first_skipped(start)
        limit = request.num_tokens if skipped is None else skipped
        return self._parts.layerwise.store(request, limit=limit, accepted=accepted)

    def retrieve_layer(
        self,
        tokens: Tokens | None = None,
        *,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        req_id: str | None = None,
        lookup_id: Hashable | None = None,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        stream: torch.cuda.Stream | None = None,
        tenant: str | None = None,
    ) -> RetrieveLayers:
        """Retrieve like :meth:`retrieve`, one layer at a time: an async iterator of
        ``num_layers + 1`` steps. The first looks up the chunks whose every layer is
        cached; step *i + 1* returns once layer *i* is in ``kv_caches``; the last yields
        the bool mask (CPU) of the tokens loaded. Only chunks stored layerwise are found.
        Pins held for ``lookup_id`` are released when the iterator ends; ``aclose()``
        before the end returns every reference taken. ``stream``: where the layers are
        read (as :meth:`retrieve`); each layer's copy has completed when its step returns.
        ``tenant`` as :meth:`retrieve`. Raises InvalidInputError here for bad input.
        """
        self._check_open()
        try:
            request, _ = self._parts.keys.prepare(
                Request,
                tokens=tokens,
                kv_caches=kv_caches,
                slot_mapping=slot_mapping,
                mask=mask,
                req_id=req_id,
                hashes=hashes,
                offsets=offsets,
                tenant=tenant,
            )
            _capture_stream(request, stream)
        except BaseException:
            if lookup_id is not None:
                self._parts.manager.unpin(lookup_id)
            raise
        request.lookup_id = lookup_id
        return self._parts.layerwise.retrieve(request, lookup_id=lookup_id)

    # -- chunks, for callers that copy KV themselves --------------------------------------

    @property
    def core(self) -> RequestCore:
        """The request core, for a caller that copies the KV itself (the sidecar): it
        runs the same store and load phases as this engine's pipelines."""
        self._check_open()
        return self._parts.core

    @property
    def key_hasher(self) -> ChunkHasher:
        """The hasher of this engine's chunk keys: a client with the same seed, algorithm
        and chunk size computes the same keys (:meth:`lookup_digests`)."""
        return self._parts.hasher

    def hasher_for(self, tenant: str | None) -> ChunkHasher:
        """The hasher of ``tenant``'s chunk keys (None: :attr:`key_hasher`).

        Raises:
            InvalidInputError: ``tenant`` is not a valid tenant name.
        """
        return self._parts.hashers.for_tenant(tenant)

    async def chunk_spans(
        self,
        tokens: Tokens | None = None,
        *,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        start: int = 0,
        tenant: str | None = None,
    ) -> tuple[list[ChunkSpan], np.ndarray | None]:
        """The chunks of a request from token ``start`` (a chunk boundary) on, as store
        and retrieve cut it for ``tenant``, and its tokens as int32 (None when keyed by
        ``hashes``). A long prompt is hashed in a worker thread. Raises InvalidInputError
        for bad input."""
        self._check_open()
        return await self._parts.keys.chunk_spans(
            tokens, hashes=hashes, offsets=offsets, start=start, tenant=tenant
        )


def _capture_stream(request: Request, stream: torch.cuda.Stream | None) -> None:
    """Take the point on the caller's stream a request over CUDA caches is ordered
    against; nothing for caches on the CPU (``stream`` is ignored there).

    Raises:
        InvalidInputError: ``stream`` is not a CUDA stream of the caches' device.
    """
    device = request.plan.device
    if device.type == "cuda":
        request.caller_stream = caller_stream(device, stream)


def _loaded_keys(spans: Sequence[ChunkSpan], mask: torch.Tensor) -> list[ChunkKey]:
    """The keys of the chunks a retrieve loaded, from the first loaded chunk on."""
    first = next((span for span in spans if mask[span.start]), None)
    if first is None:
        return []
    return [span.key for span in spans if span.start >= first.start and mask[span.end - 1]]


class _EngineContext:
    """What :meth:`CacheEngine.open` returns: ``async with`` yields the running engine."""

    def __init__(self, engine: CacheEngine) -> None:
        self._engine = engine
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> CacheEngine:
        await self._stack.__aenter__()
        try:
            await self._engine._start(self._stack)
        except BaseException:
            await self._engine.aclose()
            await self._stack.aclose()
            raise
        return self._engine

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        try:
            await self._engine.aclose()
        finally:
            suppressed = await self._stack.__aexit__(exc_type, exc, tb)
        return suppressed
