"""The cache engine: the public async API over the request core, pipelines and tiers.

``CacheEngine.open(config, layout, model_name=...)`` is an async context manager that builds
the memory pool, the tiers, the request core and both pipelines, and tears all of them down
on exit. :class:`~lmcache_async.sync_engine.SyncCacheEngine` runs the same engine on an
event-loop thread of its own for callers that are not async. The engine is wiring: its
parts, each built here with its dependencies passed in, are the key input
(:mod:`.requests`), the request core (:mod:`lmcache_async.core`), the run policy
(:mod:`.execute`), lookups and pins (:mod:`.lookups`) and the tiers (:mod:`.tiers`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Hashable, Sequence
from types import TracebackType

import anyio
import anyio.to_thread
import numpy as np
import structlog
import torch
from anyio import CancelScope
from anyio.abc import TaskGroup

from ..backends.codec import Codec
from ..backends.cpu import CPUBackend
from ..backends.manager import StorageManager
from ..backends.record import RecordSpec
from ..config import EngineConfig
from ..core import LoadCore, RequestCore, StoreCore
from ..cuda import Transfers
from ..errors import ConfigError, EngineClosedError, InvalidInputError
from ..events import EventBuffer, KVEvent
from ..health import HealthMonitor
from ..keys import ChunkHasher, ChunkKey, ChunkSpan, DigestFrames, HashAlgorithm, Namespace
from ..layouts import KVCacheViews, KVLayout
from ..memory import MemoryObj, MemoryPool
from ..pipelines.common import Request
from ..pipelines.layerwise import LayerwisePipeline, RetrieveLayers, StoreLayers
from ..pipelines.retrieve import RetrieveRequest, build_retrieve_stages
from ..pipelines.stage import Pipeline
from ..pipelines.store import StoreRequest, build_store_stages
from ..stats import Counters, EngineStats
from ..tokens import Tokens
from .compress import reencode_prefix
from .execute import Runner
from .lookups import Lookups
from .requests import RequestKeys
from .snapshot import engine_stats
from .tiers import check_tier_settings, open_slow_tiers, record_spec

__all__ = ["CacheEngine"]

log = structlog.get_logger(__name__)

# Long prompts whose chunk digests are remembered: a prompt is typically looked up,
# retrieved and stored in turn.
_DIGEST_MEMO_PROMPTS = 32


class CacheEngine:
    """Stores and retrieves the KV cache of token prefixes for one model and KV layout.

    Create it with :meth:`open`. Methods are called from the event loop that opened it.
    Input errors raise :class:`~lmcache_async.errors.InvalidInputError` before anything is
    stored; after :meth:`aclose` every method raises
    :class:`~lmcache_async.errors.EngineClosedError`.
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
        self._hasher = ChunkHasher(
            self.namespace,
            chunk_size=config.chunk_size,
            algorithm=HashAlgorithm(config.hash_algorithm),
            memo_size=_DIGEST_MEMO_PROMPTS,
        )
        self._kv_views = KVCacheViews(layout)  # the serving engine's caches, checked once
        # A sidecar's lookups come as digest frames.
        self._keys = RequestKeys(
            config, self._hasher, DigestFrames(_DIGEST_MEMO_PROMPTS), self._kv_views
        )
        self._events = EventBuffer(config.max_kv_events, enabled=config.enable_kv_events)
        self._pool = (
            MemoryPool(config.cpu_capacity_bytes)
            if pool_buffer is None
            else MemoryPool.from_buffer(pool_buffer)
        )
        chunk_bytes = math.prod(layout.payload_shape(config.chunk_size)) * layout.dtype.itemsize
        if chunk_bytes > self._pool.capacity_bytes:
            raise ConfigError(
                "max_local_cpu_size",
                f"{config.max_local_cpu_size} GB holds less than one chunk of this layout "
                f"({chunk_bytes} bytes for {config.chunk_size} tokens)",
            )
        check_tier_settings(config)
        cpu = CPUBackend(self._pool)
        self._manager = StorageManager(
            cpu,
            events=self._events,
            chunk_size=config.chunk_size,
            pin_timeout=config.pin_timeout,
            hot_cache=config.local_cpu,
            store_location=config.store_location,
            retrieve_locations=config.retrieve_locations,
            write_queue_size=config.slow_tier_queue_size,
            wait_for_slow_tiers=config.wait_for_slow_tiers,
        )
        cpu.set_eviction_listener(self._manager.on_evicted)
        self._health: HealthMonitor | None = None
        self._health_scope = CancelScope()
        self._counters = Counters()
        self._transfers = Transfers(inline_bytes=config.inline_copy_bytes)
        self._layerwise = LayerwisePipeline(
            self._manager,
            self._pool,
            layout,
            self._transfers,
            self._counters,
            healthy=self.is_healthy,
            allocation_timeout=config.allocation_timeout,
            store_timeout=config.store_timeout,
            retrieve_timeout=config.retrieve_timeout,
            remove_after_retrieve=config.remove_after_retrieve,
        )
        load = LoadCore(
            self._manager,
            self._counters,
            batch_chunks=config.pipeline_batch_chunks,
            timeout=config.retrieve_timeout,
            healthy=self.is_healthy,
            # Late bound: the lookups are built next, with this core.
            pins_changed=lambda: self._lookups.pins_changed(),  # noqa: PLW0108
        )
        self._lookups = Lookups(
            config, self._manager, load, self._layerwise, self._counters, healthy=self.is_healthy
        )
        store = StoreCore(
            self._manager,
            self._pool,
            layout,
            self._counters,
            allocation_timeout=config.allocation_timeout,
            healthy=self.is_healthy,
        )
        self._core = RequestCore(store, load, self._pool)
        self._runner = Runner(
            self._manager,
            self._counters,
            token_bytes=layout.token_bytes,
            inline_copy_bytes=config.inline_copy_bytes,
        )
        self._store_pipe = Pipeline(
            "store",
            build_store_stages(
                store,
                self._transfers,
                batch_chunks=config.pipeline_batch_chunks,
                copy_timeout=config.store_timeout,
            ),
            buffer_size=config.pipeline_queue_size,
        )
        self._retrieve_pipe = Pipeline(
            "retrieve",
            build_retrieve_stages(
                load,
                self._transfers,
                batch_chunks=config.pipeline_batch_chunks,
                copy_timeout=config.retrieve_timeout,
            ),
            buffer_size=config.pipeline_queue_size,
        )
        self._started = False
        self._closed = False

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
        allocated here; the caller keeps it mapped until the engine is closed. Raises
        InvalidInputError for a bad argument.
        """
        if not isinstance(config, EngineConfig):
            raise InvalidInputError("config must be an EngineConfig")
        if not isinstance(layout, KVLayout):
            raise InvalidInputError("layout must be a KVLayout")
        if not isinstance(model_name, str) or not model_name:
            raise InvalidInputError("model_name must be a non-empty string")
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
        slow = await open_slow_tiers(self.config, self._pool, self.record_spec())
        self._manager.attach_slow_tiers(slow)
        await stack.enter_async_context(self._store_pipe)
        await stack.enter_async_context(self._retrieve_pipe)
        task_group: TaskGroup = await stack.enter_async_context(anyio.create_task_group())
        await task_group.start(self._lookups.reap_pins, name="pin-reaper")
        self._core.load.start(task_group)
        await self._manager.start(task_group)
        if slow:
            self._health = HealthMonitor(
                slow, interval=self.config.health_check_interval, timeout=self.config.remote_timeout
            )
            task_group.start_soon(self._watch_health, name="tier-health")
        self._started = True
        log.info(
            "engine_started",
            model=self.namespace.model_name,
            layout=self.layout.fingerprint,
            cpu_bytes=self._pool.capacity_bytes,
            chunk_size=self.config.chunk_size,
            tiers=list(self._manager.tier_names),
        )

    def record_spec(self, codec: Codec | None = None) -> RecordSpec:
        """How this engine's chunks are written to disk and Redis."""
        return record_spec(self.config, self.layout, codec)

    async def _watch_health(self) -> None:
        assert self._health is not None
        with self._health_scope:
            await self._health.run()

    async def aclose(self) -> None:
        """Finish queued work, stop the pipelines and release every byte of host memory."""
        if self._closed:
            return
        self._closed = True
        await self._store_pipe.aclose()
        await self._retrieve_pipe.aclose()
        if self._started:
            with anyio.move_on_after(self.config.store_timeout, shield=True):
                await self._store_pipe.wait_stopped()
                await self._retrieve_pipe.wait_stopped()
        await self._lookups.stop_reaping()
        self._health_scope.cancel()
        # Joining the copy and bridge threads blocks: do it off the event loop, and finish
        # it even when the closing task is being cancelled.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._transfers.close)
        with anyio.CancelScope(shield=True):
            await self._manager.aclose(drain_timeout=self.config.store_timeout)
        self._pool.close()
        self._kv_views.forget()
        log.info("engine_closed", model=self.namespace.model_name)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the cache engine is closed")
        if not self._started:
            raise EngineClosedError(
                "the cache engine is not started: use `async with CacheEngine.open(...)`"
            )

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
        ``wait_for_slow_tiers`` is set. Raises InvalidInputError (nothing stored) for bad
        input.
        """
        self._check_open()
        locations = self.check_locations(store_location, "store_location")
        request, start = self._keys.prepare(
            StoreRequest,
            tokens=tokens,
            kv_caches=kv_caches,
            slot_mapping=slot_mapping,
            mask=mask,
            req_id=req_id,
            hashes=hashes,
            offsets=offsets,
        )
        request.locations = locations
        if not self._core.store.open():
            return 0
        skipped = request.plan.first_skipped(start)
        request.limit = request.num_tokens if skipped is None else skipped
        stored = await self._runner.execute(
            self._store_pipe,
            request,
            request.completion,
            self.config.store_timeout,
            inline=self._runner.runs_inline(request, locations),
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
    ) -> torch.Tensor:
        """Load the cached KV of the longest cached run of chunks from the mask start on.

        Returns a bool CPU tensor of ``len(tokens)``: True exactly for the tokens whose KV
        was written into ``kv_caches``; nothing outside it is written, and tokens with a
        negative slot are never written. Chunks held only by disk or Redis are read into
        host memory (and kept in the CPU tier); ``retrieve_locations`` limits the tiers read.
        Chunks prefetched (:meth:`prefetch`) and pins held for ``lookup_id`` are used, then
        released when it finishes. With ``remove_after_retrieve`` the loaded chunks are
        removed from the cache. Raises InvalidInputError for bad input.
        """
        self._check_open()
        load = self._core.load
        request: RetrieveRequest | None = None
        try:
            locations = self.check_locations(retrieve_locations, "retrieve_locations")
            request, _ = self._keys.prepare(
                RetrieveRequest,
                tokens=tokens,
                kv_caches=kv_caches,
                slot_mapping=slot_mapping,
                mask=mask,
                req_id=req_id,
                hashes=hashes,
                offsets=offsets,
            )
            request.locations = locations
            request.lookup_id = lookup_id
            request.mask = torch.zeros(request.num_tokens, dtype=torch.bool)
            if not await load.begin(lookup_id):
                return request.mask
            result = await self._runner.execute(
                self._retrieve_pipe,
                request,
                request.completion,
                self.config.retrieve_timeout,
                inline=self._runner.runs_inline(request, locations),
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
    ) -> StoreLayers:
        """Store like :meth:`store`, one layer at a time: an async iterator of
        ``num_layers + 1`` steps (await one after each layer's compute, which starts that
        layer's copy, and one more at the end, which yields the tokens stored; the others
        yield None). Each chunk is stored as one ``KV_T2D`` payload per layer and counts as
        cached once every layer is. ``aclose()`` before the end stores nothing and returns
        the memory taken. Raises InvalidInputError here for bad input (tokens checked off
        the loop: at the first step).
        """
        self._check_open()
        request, start = self._keys.prepare(
            Request,
            tokens=tokens,
            kv_caches=kv_caches,
            slot_mapping=slot_mapping,
            mask=mask,
            req_id=req_id,
            hashes=hashes,
            offsets=offsets,
        )
        self._counters.store_requests += 1
        skipped = request.plan.first_skipped(start)
        limit = request.num_tokens if skipped is None else skipped
        return self._layerwise.store(request, limit=limit)

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
    ) -> RetrieveLayers:
        """Retrieve like :meth:`retrieve`, one layer at a time: an async iterator of
        ``num_layers + 1`` steps. The first looks up the chunks whose every layer is
        cached; step *i + 1* returns once layer *i* is in ``kv_caches``; the last yields
        the bool mask (CPU) of the tokens loaded. Only chunks stored layerwise are found.
        Pins held for ``lookup_id`` are released when the iterator ends; ``aclose()``
        before the end returns every reference taken. Raises InvalidInputError here for
        bad input.
        """
        self._check_open()
        try:
            request, _ = self._keys.prepare(
                Request,
                tokens=tokens,
                kv_caches=kv_caches,
                slot_mapping=slot_mapping,
                mask=mask,
                req_id=req_id,
                hashes=hashes,
                offsets=offsets,
            )
        except BaseException:
            if lookup_id is not None:
                self._manager.unpin(lookup_id)
            raise
        request.lookup_id = lookup_id
        self._counters.retrieve_requests += 1
        return self._layerwise.retrieve(request, lookup_id=lookup_id)

    # -- lookups --------------------------------------------------------------------------

    async def lookup(
        self,
        tokens: Tokens | None = None,
        *,
        lookup_id: Hashable | None = None,
        pin: bool = False,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        search_range: Sequence[str] | None = None,
    ) -> int:
        """Number of prefix tokens (from token 0) whose KV is cached in any tier.

        The prefix may begin in the CPU tier and continue on disk or in Redis;
        ``search_range`` limits the tiers asked (default: ``retrieve_locations``). With
        ``pin=True`` and a ``lookup_id`` the chunks in the CPU tier are pinned (never
        evicted) until :meth:`lookup_unpin`, a :meth:`retrieve` with the same id, or
        ``pin_timeout``. Raises InvalidInputError for bad input.
        """
        self._check_open()
        if pin and lookup_id is None:
            raise InvalidInputError("pin=True needs a lookup_id")
        locations = self.check_locations(search_range, "search_range")
        keys, ends, num_tokens = await self._keys.lookup_keys(tokens, hashes, offsets)
        return await self._lookups.lookup(
            keys, ends, num_tokens, lookup_id=lookup_id, pin=pin, locations=locations
        )

    async def lookup_digests(
        self,
        digests: Sequence[bytes] | bytes | memoryview,
        num_tokens: int,
        *,
        lookup_id: Hashable | None = None,
        pin: bool = False,
        search_range: Sequence[str] | None = None,
    ) -> int:
        """As :meth:`lookup`, for a prompt of ``num_tokens`` tokens whose chunk digests
        (:attr:`key_hasher`'s ``digests``, one per chunk, the last maybe short) were
        computed by the caller, e.g. a sidecar client: no tokens cross the wire.
        ``digests`` may also come as their concatenation (bytes or a view, as a wire frame
        holds them).

        Raises:
            InvalidInputError: ``num_tokens`` is not an int >= 0, the number of digests is
                not that of its chunks, a digest is not ``DIGEST_SIZE`` bytes, or as
                :meth:`lookup`.
        """
        self._check_open()
        locations = self.check_locations(search_range, "search_range")
        keys = self._keys.digest_keys(digests, num_tokens, lookup_id=lookup_id, pin=pin)
        return await self._lookups.lookup(
            keys, [], num_tokens, lookup_id=lookup_id, pin=pin, locations=locations
        )

    def lookup_digests_now(
        self,
        digests: Sequence[bytes] | bytes | memoryview,
        num_tokens: int,
        *,
        lookup_id: Hashable | None = None,
        pin: bool = False,
    ) -> int | None:
        """:meth:`lookup_digests` over the configured tiers, answered without waiting when
        the CPU tier can answer it alone; None (nothing done) when disk or Redis must be
        asked, the engine is layerwise or unhealthy: then await :meth:`lookup_digests`.
        A socket reader on the event loop's callbacks answers most lookups this way.

        Raises:
            InvalidInputError: as :meth:`lookup_digests`.
        """
        self._check_open()
        keys = self._keys.digest_keys(digests, num_tokens, lookup_id=lookup_id, pin=pin)
        return self._lookups.now(keys, [], num_tokens, lookup_id=lookup_id, pin=pin)

    async def prefetch(
        self,
        tokens: Tokens | None = None,
        *,
        lookup_id: Hashable,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        search_range: Sequence[str] | None = None,
    ) -> int:
        """Look up a prompt and start loading its hits from disk or Redis into host memory.

        Returns the prefix tokens cached (as :meth:`lookup`) at once; the loading runs in
        the background, and a later :meth:`retrieve` with the same ``lookup_id`` waits for
        it and is served from what it loaded (pinned until then, or ``pin_timeout``).
        Raises InvalidInputError for bad input.
        """
        self._check_open()
        if lookup_id is None:
            raise InvalidInputError("prefetch needs a lookup_id")
        locations = self.check_locations(search_range, "search_range")
        keys, ends, num_tokens = await self._keys.lookup_keys(tokens, hashes, offsets)
        return await self._lookups.prefetch(
            keys, ends, num_tokens, lookup_id=lookup_id, locations=locations
        )

    async def lookup_unpin(self, lookup_id: Hashable) -> None:
        """Release the pins taken by :meth:`lookup` for ``lookup_id`` (no-op if none)."""
        self._check_open()
        self._manager.unpin(lookup_id)

    # -- chunks, for callers that copy KV themselves --------------------------------------

    @property
    def core(self) -> RequestCore:
        """The request core, for a caller that copies the KV itself (the sidecar): it
        runs the same store and load phases as this engine's pipelines."""
        self._check_open()
        return self._core

    @property
    def key_hasher(self) -> ChunkHasher:
        """The hasher of this engine's chunk keys: a client with the same seed, algorithm
        and chunk size computes the same keys (:meth:`lookup_digests`)."""
        return self._hasher

    async def chunk_spans(
        self,
        tokens: Tokens | None = None,
        *,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        start: int = 0,
    ) -> tuple[list[ChunkSpan], np.ndarray | None]:
        """The chunks of a request from token ``start`` (a chunk boundary) on, as store
        and retrieve cut it, and its tokens as int32 (None when keyed by ``hashes``). A long
        prompt is hashed in a worker thread. Raises InvalidInputError for bad input."""
        self._check_open()
        return await self._keys.chunk_spans(tokens, hashes=hashes, offsets=offsets, start=start)

    def check_locations(self, locations: Sequence[str] | None, name: str) -> tuple[str, ...] | None:
        """Validated per-call tier names, or None for the configured ones.

        Raises:
            InvalidInputError: a name that is not an enabled tier (``name`` is the field).
        """
        if locations is None:
            return None
        return self._manager.check_locations(locations, name)

    # -- tiers and switches ---------------------------------------------------------------

    async def compress(
        self,
        tokens: Tokens | None = None,
        method: str = "zstd",
        location: str = "disk",
        *,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
    ) -> int:
        """Re-encode the stored chunks of a prompt's cached prefix in a slow tier.

        ``method``: ``zstd`` or ``lz4`` (lossless), ``int8`` (lossy, per-channel scale) or
        ``none`` (what :meth:`decompress` uses). ``location``: ``disk`` or ``redis``. Returns
        the number of chunks re-encoded. Raises InvalidInputError for an unknown method or a
        location that is not an enabled slow tier.
        """
        self._check_open()
        codec = Codec.parse(method)
        tier = self._manager.tier(location)
        if tier.name == "cpu":
            raise InvalidInputError("compress works on the disk or redis tier, not on cpu")
        keys, _, _ = await self._keys.lookup_keys(tokens, hashes, offsets)
        return await reencode_prefix(
            tier, keys, self.record_spec(codec), batch_chunks=self.config.pipeline_batch_chunks
        )

    async def decompress(
        self,
        tokens: Tokens | None = None,
        location: str = "disk",
        *,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
    ) -> int:
        """Store a prompt's chunks in ``location`` without compression again (the inverse of
        :meth:`compress`; a lossy ``int8`` encoding stays as lossy as it was). Returns the
        number of chunks re-encoded."""
        return await self.compress(tokens, "none", location, hashes=hashes, offsets=offsets)

    async def check_health(self) -> dict[str, bool]:
        """Probe every tier now (instead of waiting for the monitor's next round); returns
        each tier's state."""
        self._check_open()
        if self._health is not None:
            await self._health.check_once()
        return self._manager.tier_health()

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until chunks queued for disk and Redis are written (at most ``timeout``
        seconds, default ``store_timeout``); False when time ran out."""
        self._check_open()
        return await self._manager.flush(self.config.store_timeout if timeout is None else timeout)

    async def clear(self, locations: Sequence[str] | None = None) -> int:
        """Drop every cached chunk of the named tiers (default: all) and, with the CPU tier,
        every pin; returns how many chunks were dropped."""
        self._check_open()
        return await self._manager.clear(self.check_locations(locations, "locations"))

    def freeze(self, enabled: bool) -> None:
        """Freeze mode: stores write nothing; lookups and retrieves are still served."""
        self._check_open()
        self._manager.freeze(enabled)

    def set_hot_cache(self, enabled: bool) -> None:
        """Switch the CPU hot cache: when off, stores keep nothing new in host memory."""
        self._check_open()
        self._manager.set_hot_cache(enabled)

    @property
    def accepts_writes(self) -> bool:
        """Whether a store could keep anything now (open, healthy, not frozen, and some
        target tier takes writes)."""
        return not self._closed and self._manager.accepts_writes and self.is_healthy()

    def take_events(self) -> list[KVEvent]:
        """Return and forget the KV events (chunks stored / removed) recorded so far."""
        return self._events.take()

    async def wait_events(self) -> None:
        """Return once at least one KV event is waiting for :meth:`take_events` (never
        while events are disabled: bound it with a cancel scope)."""
        await self._events.wait()

    def is_healthy(self) -> bool:
        """True while the engine is open, its pipelines run and its tiers can serve."""
        return (
            not self._closed
            and self._store_pipe.running
            and self._retrieve_pipe.running
            and self._manager.healthy()
        )

    def stats(self) -> EngineStats:
        """A snapshot of traffic, memory, tiers and switches."""
        return engine_stats(
            self._counters, self._pool, self._manager, self._events, healthy=self.is_healthy()
        )

    # -- TEMPORARY: the sidecar's old chunk-level API, until it runs on `core` ------------

    def hold_chunks(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        self._check_open()
        return self._manager.hold(keys)

    async def allocate_chunk(self, num_tokens: int) -> MemoryObj:
        self._check_open()
        if not isinstance(num_tokens, int) or not 0 < num_tokens <= self.config.chunk_size:
            raise InvalidInputError(
                f"num_tokens must be in [1, {self.config.chunk_size}], got {num_tokens!r}"
            )
        shape = self.layout.payload_shape(num_tokens)
        obj = self._pool.allocate_nowait(shape, self.layout.dtype)
        if obj is None:
            obj = await self._pool.allocate(
                shape, self.layout.dtype, timeout=self.config.allocation_timeout
            )
        return obj

    def buffer_offset(self, obj: MemoryObj) -> int:
        return self._core.buffer_offset(obj)

    async def put_chunks(
        self,
        spans: Sequence[ChunkSpan],
        objs: Sequence[MemoryObj],
        tokens: np.ndarray | None = None,
        *,
        store_location: Sequence[str] | None = None,
    ) -> int:
        self._check_open()
        locations = self.check_locations(store_location, "store_location")
        return await self._manager.put(spans, objs, tokens, locations)

    async def fetch_chunks(
        self,
        keys: Sequence[ChunkKey],
        *,
        lookup_id: Hashable | None = None,
        retrieve_locations: Sequence[str] | None = None,
    ) -> list[MemoryObj]:
        self._check_open()
        locations = self.check_locations(retrieve_locations, "retrieve_locations")
        if not self.is_healthy() or not keys:
            return []
        self._counters.retrieve_requests -= 1  # begin counts; record_request counts again
        await self._core.load.begin(lookup_id)
        return await self._core.load.reserve(keys, locations, lookup_id)

    def record_request(self, kind: str, tokens: int, *, partial: bool = False) -> None:
        counters = self._counters
        if kind == "store":
            counters.store_requests += 1
            counters.stored_tokens += tokens
            counters.partial_stores += int(partial)
        elif kind == "retrieve":
            counters.retrieve_requests += 1
            counters.retrieved_tokens += tokens
        else:
            raise InvalidInputError(f"kind must be 'store' or 'retrieve', got {kind!r}")

    async def move(
        self,
        tokens: Tokens,
        old_position: str,
        new_position: tuple[str, str] | Sequence[str],
        copy: bool = True,
        *,
        timeout: float | None = None,
    ) -> int:
        from ..rpc.move import move  # noqa: PLC0415

        return await move(self, tokens, old_position, new_position, copy, timeout=timeout)


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
