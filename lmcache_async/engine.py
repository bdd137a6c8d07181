"""The cache engine: the public async API over the pipelines and the storage tiers.

``CacheEngine.open(config, layout, model_name=...)`` is an async context manager that builds
the memory pool, the tiers and both pipelines, and tears all of them down on exit.
:class:`~lmcache_async.sync_engine.SyncCacheEngine` (in :mod:`lmcache_async.sync_engine`)
runs the same engine on an event-loop thread of its own for callers that are not async.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import math
import time
from collections.abc import Hashable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread
import numpy as np
import structlog
import torch
from anyio import CancelScope
from anyio.abc import TaskGroup, TaskStatus

from .backends.base import StorageBackend
from .backends.codec import Codec
from .backends.cpu import CPUBackend
from .backends.disk import DiskBackend
from .backends.manager import StorageManager, chunk_keys
from .backends.record import RecordSpec, object_checksum
from .config import EngineConfig
from .cuda import Transfers
from .errors import ConfigError, EngineClosedError, InvalidInputError, TierUnavailableError
from .events import EventBuffer, KVEvent
from .health import HealthMonitor
from .keys import (
    DIGEST_SIZE,
    ChunkHasher,
    ChunkKey,
    ChunkSpan,
    DigestFrames,
    HashAlgorithm,
    Namespace,
    check_mask,
    token_array,
)
from .layouts import KVCacheViews, KVFormat, KVLayout, LayoutKind
from .memory import MemoryObj, MemoryPool
from .pipelines.common import Keyer, Request
from .pipelines.layerwise import LayerwisePipeline, RetrieveLayers, StoreLayers
from .pipelines.retrieve import RetrieveRequest, build_retrieve_stages
from .pipelines.stage import Completion, Pipeline
from .pipelines.store import StoreRequest, build_store_stages
from .stats import Counters, EngineStats
from .tokens import is_strict_int

if TYPE_CHECKING:
    from .rpc.client import RemoteCacheEngine

__all__ = ["CacheEngine"]

log = structlog.get_logger(__name__)

Tokens = Sequence[int] | torch.Tensor | np.ndarray
T = TypeVar("T")
R = TypeVar("R", bound=Request)

# Long prompts whose chunk digests are remembered: a prompt is typically looked up,
# retrieved and stored in turn.
_DIGEST_MEMO_PROMPTS = 32

# How long a retrieve that timed out waits for a copy already under way, so that the mask it
# returns covers every slot that was written.
_ABANDON_GRACE_SECONDS = 10.0

# Payload bytes a move sends to its target in one message.
_MOVE_BATCH_BYTES = 64 << 20
# Below this many payload bytes a move's checksums are computed on the event loop.
_MOVE_INLINE_CHECKSUM_BYTES = 4 << 20


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
        self._kv_views = KVCacheViews(layout)  # the serving engine's caches, checked once
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
        self._frames = DigestFrames(_DIGEST_MEMO_PROMPTS)  # a sidecar's lookups by digests
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
        _check_tier_settings(config)
        self._cpu = CPUBackend(self._pool)
        self._manager = StorageManager(
            self._cpu,
            events=self._events,
            chunk_size=config.chunk_size,
            pin_timeout=config.pin_timeout,
            hot_cache=config.local_cpu,
            store_location=config.store_location,
            retrieve_locations=config.retrieve_locations,
            write_queue_size=config.slow_tier_queue_size,
            wait_for_slow_tiers=config.wait_for_slow_tiers,
        )
        self._health: HealthMonitor | None = None
        self._background: TaskGroup | None = None
        self._prefetches: dict[Hashable, anyio.Event] = {}
        self._cpu.set_eviction_listener(self._manager.on_evicted)
        self._transfers = Transfers(inline_bytes=config.inline_copy_bytes)
        self._store_pipe = Pipeline(
            "store",
            build_store_stages(
                self._manager,
                self._pool,
                layout,
                self._transfers,
                batch_chunks=config.pipeline_batch_chunks,
                allocation_timeout=config.allocation_timeout,
                copy_timeout=config.store_timeout,
            ),
            buffer_size=config.pipeline_queue_size,
        )
        self._retrieve_pipe = Pipeline(
            "retrieve",
            build_retrieve_stages(
                self._manager,
                layout,
                self._transfers,
                batch_chunks=config.pipeline_batch_chunks,
                copy_timeout=config.retrieve_timeout,
            ),
            buffer_size=config.pipeline_queue_size,
        )
        self._counters = Counters()
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
        self._request_ids = itertools.count()
        self._pins_changed = anyio.Event()
        self._reaper_scope: CancelScope | None = None
        self._reaper_stopped = anyio.Event()
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
        return _EngineContext(
            cls(
                config,
                layout,
                model_name=model_name,
                revision=revision,
                tenant=tenant,
                pool_buffer=pool_buffer,
            )
        )

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        slow = await open_slow_tiers(self.config, self._pool, self.record_spec())
        self._manager.attach_slow_tiers(slow)
        await stack.enter_async_context(self._store_pipe)
        await stack.enter_async_context(self._retrieve_pipe)
        task_group = await stack.enter_async_context(anyio.create_task_group())
        self._background = task_group
        await task_group.start(self._reap_pins, name="pin-reaper")
        await self._manager.start(task_group)
        if slow:
            self._health = HealthMonitor(
                slow,
                interval=self.config.health_check_interval,
                timeout=self.config.remote_timeout,
            )
            self._health_scope = CancelScope()
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
        return RecordSpec(
            fingerprint=self.layout.fingerprint,
            fmt=str(self.layout.fmt),
            dtype=self.layout.dtype,
            max_tokens=self.config.chunk_size,
            shape_of=self.layout.payload_shape,
            codec=Codec(self.config.tier_codec) if codec is None else codec,
            layer_fmt=str(
                KVFormat.KV_MLA if self.layout.kind is LayoutKind.MLA else KVFormat.KV_T2D
            ),
            layer_shape_of=self.layout.layer_payload_shape,
        )

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
        if self._reaper_scope is not None:
            self._reaper_scope.cancel()
            with anyio.CancelScope(shield=True):
                await self._reaper_stopped.wait()
        if self._health is not None:
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

    async def _reap_pins(
        self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Release lookup pins that outlive ``pin_timeout`` (a caller that forgot them)."""
        try:
            with anyio.CancelScope() as self._reaper_scope:
                task_status.started()
                while True:
                    deadline = self._manager.next_pin_deadline()
                    if deadline is None:
                        await self._pins_changed.wait()
                        self._pins_changed = anyio.Event()
                        continue
                    await anyio.sleep(max(0.0, deadline - time.monotonic()))
                    self._manager.expire_pins()
        finally:
            self._reaper_stopped.set()

    # -- requests -------------------------------------------------------------------------

    def _keys(
        self,
        tokens: Tokens | None,
        hashes: Sequence[int | bytes] | None,
        offsets: Sequence[int] | None,
        mask: torch.Tensor | None,
    ) -> tuple[Keyer, int, bool]:
        """Validate the key input; return (keyer, number of tokens, hash on the loop?)."""
        save_unfull = self.config.save_unfull_chunk
        hasher = self._hasher
        if hashes is not None:
            if tokens is not None:
                raise InvalidInputError("pass either tokens or hashes, not both")
            if offsets is None:
                raise InvalidInputError("hashes need offsets (the end token offset of each hash)")
            hash_list = _sequence("hashes", hashes)
            offsets = _sequence("offsets", offsets)
            last = offsets[-1] if offsets else 0
            if not isinstance(last, int) or isinstance(last, bool):
                raise InvalidInputError(f"offsets must be ints, got {last!r:.40}")
            num_tokens = last

            def from_hashes() -> tuple[list[ChunkSpan], np.ndarray | None]:
                spans = hasher.spans_from_hashes(
                    hash_list, offsets, mask=mask, save_unfull_chunk=save_unfull
                )
                return spans, None

            return from_hashes, num_tokens, True
        if tokens is None:
            raise InvalidInputError("tokens (or hashes with offsets) are required")
        if offsets is not None:
            raise InvalidInputError("offsets go with hashes, not with tokens")
        if isinstance(tokens, (torch.Tensor, np.ndarray)):
            if tokens.ndim != 1:
                raise InvalidInputError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
            num_tokens = int(tokens.shape[0])
        else:
            num_tokens = len(_check_sequence("tokens", tokens))
        source = tokens

        def from_tokens() -> tuple[list[ChunkSpan], np.ndarray | None]:
            array = token_array(source)  # validated once, here
            return hasher.array_spans(array, mask=mask, save_unfull_chunk=save_unfull), array

        return from_tokens, num_tokens, num_tokens < self.config.inline_hash_tokens

    def _prepare(
        self,
        *,
        request_type: type[R],
        tokens: Tokens | None,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None,
        req_id: str | None,
        hashes: Sequence[int | bytes] | None,
        offsets: Sequence[int] | None,
    ) -> tuple[R, int]:
        keyer, num_tokens, inline = self._keys(tokens, hashes, offsets, mask)
        start = check_mask(mask, num_tokens, self.config.chunk_size)
        plan, slots_cpu = self._kv_views.plan(kv_caches, slot_mapping, num_tokens)
        request = request_type(
            req_id=req_id if req_id is not None else f"req-{next(self._request_ids)}",
            keyer=keyer,
            num_tokens=num_tokens,
            hash_inline=inline,
            plan=plan,
            slots_cpu=slots_cpu,
        )
        if inline:
            # Short prompts are hashed here: invalid tokens fail before anything is queued.
            request.spans, request.tokens = keyer()
            request.hash_inline = True
            request.keyer = _already_hashed(request)
        return request, start

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
        locations = self._locations(store_location, "store_location")
        request, start = self._prepare(
            request_type=StoreRequest,
            tokens=tokens,
            kv_caches=kv_caches,
            slot_mapping=slot_mapping,
            mask=mask,
            req_id=req_id,
            hashes=hashes,
            offsets=offsets,
        )
        request.locations = locations
        self._counters.store_requests += 1
        if not self._manager.accepts_writes or not self.is_healthy():
            return 0
        skipped = request.plan.first_skipped(start)
        request.limit = request.num_tokens if skipped is None else skipped
        stored = await self._execute(
            self._store_pipe,
            request,
            request.completion,
            self.config.store_timeout,
            inline=self._runs_inline(request, locations),
        )
        if stored is None:
            stored = request.stored_tokens() if request.spans else 0
        self._counters.stored_tokens += stored
        if request.partial:
            self._counters.partial_stores += 1
        return stored

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
        try:
            locations = self._locations(retrieve_locations, "retrieve_locations")
            request, _ = self._prepare(
                request_type=RetrieveRequest,
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
            self._counters.retrieve_requests += 1
            request.mask = torch.zeros(request.num_tokens, dtype=torch.bool)
            if not self.is_healthy():
                return request.mask
            if lookup_id is not None:
                await self._wait_prefetch(lookup_id)
            result = await self._execute(
                self._retrieve_pipe,
                request,
                request.completion,
                self.config.retrieve_timeout,
                inline=self._runs_inline(request, locations),
            )
            self._counters.retrieved_tokens += request.loaded_tokens
            if result is not None:
                if self.config.remove_after_retrieve and request.loaded_tokens:
                    await self._remove_loaded(request)
                return result
            # Timed out or failed: a snapshot, in case an abandoned copy still lands later.
            return request.mask.clone()
        finally:
            if lookup_id is not None:
                self._manager.unpin(lookup_id)

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
        ``num_layers + 1`` steps.

        Await a step after each layer's compute (step *i* starts layer *i*'s copy) and one
        more at the end, which yields the number of tokens stored; the others yield None::

            it = engine.store_layer(tokens, kv_caches=kv, slot_mapping=slots)
            for layer in range(num_layers):
                compute(layer)
                await anext(it)
            stored = await anext(it)

        Each chunk is stored as one ``KV_T2D`` payload per layer, under its layer keys, and
        counts as cached once every layer is. ``aclose()`` (or leaving ``async for``) before
        the end stores nothing and returns the memory taken. Raises InvalidInputError here
        for bad input (tokens checked off the loop: at the first step).
        """
        self._check_open()
        request, start = self._prepare(
            request_type=Request,
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
        ``num_layers + 1`` steps.

        The first step looks up the chunks whose every layer is cached; step *i + 1*
        returns once layer *i* is in ``kv_caches``. The last yields the bool mask (CPU) of
        the tokens loaded; the others yield None::

            it = engine.retrieve_layer(tokens, kv_caches=kv, slot_mapping=slots)
            await anext(it)
            for layer in range(num_layers):
                result = await anext(it)  # layer `layer` is loaded
                compute(layer)
            mask = result

        Only chunks stored layerwise (:meth:`store_layer`) are found (a :meth:`prefetch`
        reads whole chunks, so it does not serve this). Pins held for ``lookup_id`` are
        released when the iterator ends. With ``remove_after_retrieve`` every layer of the
        chunks loaded is removed from the cache at the last step. ``aclose()`` before the end
        returns every reference taken. Raises InvalidInputError here for bad input.
        """
        self._check_open()
        try:
            request, _ = self._prepare(
                request_type=Request,
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

    def _runs_inline(self, request: Request, locations: Sequence[str] | None) -> bool:
        """Whether ``request`` is small work that does not wait: hashed already, copied on
        the event loop (CPU memory, fewer than ``inline_copy_bytes``) and served by the CPU
        tier alone. Such a request runs in the caller's task, without a hop between the
        pipeline's stage tasks (each a pass of the event loop)."""
        return (
            request.hash_inline
            and request.plan.device.type == "cpu"
            and request.num_tokens * self.layout.token_bytes < self.config.inline_copy_bytes
            and (
                not self._manager.slow_tiers
                or (locations is not None and all(name == "cpu" for name in locations))
            )
        )

    async def _execute(
        self,
        pipeline: Pipeline,
        request: Request,
        completion: Completion[T],
        timeout: float,
        *,
        inline: bool = False,
    ) -> T | None:
        """Run ``request`` through ``pipeline``; None when it timed out or failed.

        A request resolves only once every batch of it is accounted for. On timeout or
        cancellation the request is marked, so the stages drop what remains and return its
        memory, and the caller waits (bounded, shielded) for a copy already under way: when
        this returns or raises, nothing of the request still touches the caller's memory.
        Raises InvalidInputError (input found invalid off the loop) and EngineClosedError.
        """
        submitted = False
        deadline = asyncio.timeout(timeout)
        try:
            # asyncio's own timeout: an anyio cancel scope costs tens of microseconds, paid
            # on every request.
            async with deadline:
                if inline:
                    # In this task (see _runs_inline): its only wait is for host memory,
                    # which the stage waiting hands back at the deadline or a cancellation;
                    # its copies run on the loop, so none is under way when it stops.
                    await pipeline.run_inline(request)
                    if not completion.done:  # every batch went through the last stage
                        raise RuntimeError("an inline request did not finish")
                    return completion.result()
                await pipeline.submit(request)
                submitted = True
                return await completion.wait()
        except TimeoutError:
            if not deadline.expired():
                # A TimeoutError from inside the pipeline (a GPU copy overdue): a failure.
                self._counters.failed_requests += 1
                log.exception("request_failed", req_id=request.req_id, pipeline=pipeline.name)
                return None
            self._counters.timed_out_requests += 1
            log.warning("request_timed_out", req_id=request.req_id, pipeline=pipeline.name)
            await self._abandon(request, completion, submitted)
            return None
        except (EngineClosedError, InvalidInputError):
            raise
        except Exception:
            self._counters.failed_requests += 1
            log.exception("request_failed", req_id=request.req_id, pipeline=pipeline.name)
            return None
        except BaseException:
            await self._abandon(request, completion, submitted)
            raise

    async def _abandon(self, request: Request, completion: Completion[T], submitted: bool) -> None:
        """Drop what remains of ``request`` and wait for a copy of it already under way."""
        request.cancel()
        if not submitted:
            return
        with anyio.move_on_after(_ABANDON_GRACE_SECONDS, shield=True):
            await completion.wait_done()
        if not completion.done:
            log.error(
                "request_abandoned_with_copy_in_flight",
                req_id=request.req_id,
                grace_seconds=_ABANDON_GRACE_SECONDS,
            )

    async def _lookup_keys(
        self,
        tokens: Tokens | None,
        hashes: Sequence[int | bytes] | None,
        offsets: Sequence[int] | None,
    ) -> tuple[Sequence[bytes], list[int], int]:
        """The chunk keys of a prompt, the end token of each (empty: every chunk is
        ``chunk_size`` long) and the prompt's length."""
        if hashes is not None:
            keyer, num_tokens, _ = self._keys(tokens, hashes, offsets, None)
            spans, _ = keyer()
            return [span.key for span in spans], [span.end for span in spans], num_tokens
        # Only the digests are needed: a whole-chunk key is its digest.
        if tokens is None:
            raise InvalidInputError("tokens (or hashes with offsets) are required")
        _, num_tokens, inline = self._keys(tokens, None, offsets, None)
        hasher = self._hasher
        keys: Sequence[bytes]
        if inline:
            keys = hasher.digests(tokens)
        else:
            # A long prompt asked about again is recognised here, without a thread hop.
            probe = hasher.probe(tokens)
            if probe.digests is not None:
                keys = probe.digests
            else:
                hash_all = functools.partial(hasher.digests, tokens, probe=probe)
                keys = await anyio.to_thread.run_sync(hash_all)
        if num_tokens % self.config.chunk_size and not self.config.save_unfull_chunk:
            keys = keys[:-1]
        return keys, [], num_tokens

    def _hit_tokens(self, hits: int, ends: list[int], num_tokens: int) -> int:
        if not hits:
            return 0
        if ends:
            return ends[hits - 1]
        return min(hits * self.config.chunk_size, num_tokens)

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
        locations = self._locations(search_range, "search_range")
        keys, ends, num_tokens = await self._lookup_keys(tokens, hashes, offsets)
        return await self._lookup(
            keys, ends, num_tokens, lookup_id=lookup_id, pin=pin, locations=locations
        )

    async def _lookup(
        self,
        keys: Sequence[bytes],
        ends: list[int],
        num_tokens: int,
        *,
        lookup_id: Hashable | None,
        pin: bool,
        locations: Sequence[str] | None,
    ) -> int:
        """The cached prefix tokens of a prompt's chunk keys (see :meth:`lookup`)."""
        if locations is None:
            answered = self._lookup_now(keys, ends, num_tokens, lookup_id=lookup_id, pin=pin)
            if answered is not None:
                return answered
        self._counters.lookup_requests += 1
        self._counters.lookup_tokens += num_tokens
        if not self.is_healthy():
            return 0
        if self.config.use_layerwise:
            # Layerwise stores keep one entry per layer: a chunk counts when all are held.
            if pin and lookup_id is not None:
                hits = self._layerwise.pin(keys, lookup_id)
                self._pins_changed.set()
                if hits < len(keys) and (self._manager.slow_tiers or locations is not None):
                    # Pins hold the CPU tier; the rest of the prefix may be on disk or in
                    # Redis, where the retrieve reads it.
                    hits = max(hits, await self._layerwise.lookup(keys, locations))
            else:
                hits = await self._layerwise.lookup(keys, locations)
        elif pin and lookup_id is not None:
            hits = self._pin_cpu(keys, lookup_id)
        else:
            # Here the CPU tier alone could not answer (_lookup_now, or named tiers):
            # lookup_prefix below counts the prefix across tiers, starting there.
            hits = 0
        if (
            not self.config.use_layerwise
            and hits < len(keys)
            and (self._manager.slow_tiers or locations is not None)
        ):
            hits = await self._manager.lookup_prefix(keys, locations)
        return self._count_hits(hits, ends, num_tokens)

    def _lookup_now(
        self,
        keys: Sequence[bytes],
        ends: list[int],
        num_tokens: int,
        *,
        lookup_id: Hashable | None,
        pin: bool,
    ) -> int | None:
        """:meth:`_lookup` over the configured tiers when the CPU tier answers it alone (it
        holds the whole prefix, or there is no slower tier); None, with nothing pinned or
        counted, when disk or Redis must be asked."""
        if self.config.use_layerwise or not self.is_healthy():
            return None
        manager = self._manager
        if manager.slow_tiers and manager.contains_prefix(keys) < len(keys):
            return None
        if pin and lookup_id is not None:
            hits = self._pin_cpu(keys, lookup_id)
        else:
            hits = manager.contains_prefix(keys)
        self._counters.lookup_requests += 1
        self._counters.lookup_tokens += num_tokens
        return self._count_hits(hits, ends, num_tokens)

    def _pin_cpu(self, keys: Sequence[bytes], lookup_id: Hashable) -> int:
        """Pin for ``lookup_id`` the leading keys the CPU tier holds; returns how many."""
        hits = self._manager.pin_prefix(keys, lookup_id)
        self._pins_changed.set()
        return hits

    def _count_hits(self, hits: int, ends: list[int], num_tokens: int) -> int:
        """The prefix tokens ``hits`` leading chunks cover, counted as a lookup's hits."""
        hit_tokens = self._hit_tokens(hits, ends, num_tokens)
        self._counters.lookup_hit_tokens += hit_tokens
        return hit_tokens

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
        A caller on the event loop's own callbacks (a socket reader) answers most lookups
        this way without starting a task.

        Raises:
            InvalidInputError: as :meth:`lookup_digests`.
        """
        self._check_open()
        keys = self._digest_keys(digests, num_tokens, lookup_id=lookup_id, pin=pin)
        return self._lookup_now(keys, [], num_tokens, lookup_id=lookup_id, pin=pin)

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
        locations = self._locations(search_range, "search_range")
        keys, ends, num_tokens = await self._lookup_keys(tokens, hashes, offsets)
        self._counters.lookup_requests += 1
        self._counters.lookup_tokens += num_tokens
        if not self.is_healthy() or self._background is None:
            return 0
        hits = await self._manager.lookup_prefix(keys, locations)
        hit_tokens = self._hit_tokens(hits, ends, num_tokens)
        self._counters.lookup_hit_tokens += hit_tokens
        if hits:
            done = anyio.Event()
            self._prefetches[lookup_id] = done
            self._background.start_soon(
                self._load_prefetch, list(keys[:hits]), locations, lookup_id, done
            )
        return hit_tokens

    async def _load_prefetch(
        self,
        keys: list[bytes],
        locations: tuple[str, ...] | None,
        lookup_id: Hashable,
        done: anyio.Event,
    ) -> None:
        """Read ``keys`` into host memory, batch by batch, and pin them for ``lookup_id``."""
        objs: list[MemoryObj] = []
        try:
            with anyio.move_on_after(self.config.retrieve_timeout):
                step = self.config.pipeline_batch_chunks
                as_keys = chunk_keys(keys)
                for start in range(0, len(as_keys), step):
                    batch = as_keys[start : start + step]
                    got = await self._manager.fetch_prefix(batch, locations)
                    objs.extend(got)
                    if len(got) < len(batch):
                        break
            if self._prefetches.get(lookup_id) is done:
                self._manager.pin_objects(keys[: len(objs)], objs, lookup_id)
                self._pins_changed.set()
                log.debug("prefetched", lookup_id=str(lookup_id), chunks=len(objs))
        except Exception:
            log.exception("prefetch_failed", lookup_id=str(lookup_id))
        finally:
            for obj in objs:
                obj.unref()  # the pin set holds its own references
            done.set()

    async def _wait_prefetch(self, lookup_id: Hashable) -> None:
        """Wait (bounded by ``retrieve_timeout``) for a prefetch under ``lookup_id``."""
        done = self._prefetches.pop(lookup_id, None)
        if done is not None:
            with anyio.move_on_after(self.config.retrieve_timeout):
                await done.wait()

    async def _remove_loaded(self, request: RetrieveRequest) -> None:
        """Remove the chunks a retrieve loaded (the receiver role of disaggregated prefill)."""
        spans = request.spans
        if not spans:
            return
        first = next((s for s in spans if request.mask[s.start]), None)
        if first is None:
            return
        loaded = [s.key for s in spans if s.start >= first.start and request.mask[s.end - 1]]
        await self._manager.remove(loaded)

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
        if tier.name == self._cpu.name:
            raise InvalidInputError("compress works on the disk or redis tier, not on cpu")
        keys, _, _ = await self._lookup_keys(tokens, hashes, offsets)
        as_keys = chunk_keys(keys)
        hits = await tier.contains_prefix(as_keys)
        spec = self.record_spec(codec)
        done = 0
        step = self.config.pipeline_batch_chunks
        for start in range(0, hits, step):
            batch = as_keys[start : min(start + step, hits)]
            got = await tier.get(batch)
            objs = [obj for obj in got if obj is not None]
            try:
                if len(objs) < len(batch):
                    break
                await tier.remove(batch)
                done += await tier.put(batch, objs, spec=spec)
            finally:
                for obj in objs:
                    obj.unref()
        log.info("chunks_reencoded", location=tier.name, method=str(codec), chunks=done)
        return done

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

    # -- moving between instances --------------------------------------------------------

    async def move(
        self,
        tokens: Tokens,
        old_position: str,
        new_position: tuple[str, str] | Sequence[str],
        copy: bool = True,
        *,
        timeout: float | None = None,
    ) -> int:
        """Copy (or, with ``copy=False``, move) the stored chunks of a prefix of ``tokens``
        from this engine's tier ``old_position`` to a sidecar's tier, over ZeroMQ.

        ``old_position``: a tier of this engine (``"cpu"``, ``"disk"``, ``"redis"``).
        ``new_position``: ``(url, location)``, the target sidecar's ``ipc://`` or ``tcp://``
        URL and the name of its tier to write. The payloads travel as inline frames (the
        target may be on another host), at most 64 MiB a message, each with the xxh3-64
        checksum of its bytes; the target verifies every one before caching it and refuses
        a corrupt one and the chunks after it. The leading run of chunks the tier holds is
        sent, stopping at the first it does not hold or the target does not take; with
        ``copy=False`` the chunks the target took are then removed from ``old_position``
        (so moving onto this very instance's same tier drops them). The target flushes its
        queued disk or Redis writes before it answers each message.

        ``timeout``: seconds each request to the target may take, the hello included
        (default ``remote_timeout``). Returns the number of prefix tokens (from token 0)
        the target took: 0 when it is unreachable (logged, within ``timeout``), when this
        engine is unhealthy, or when the tier lacks the first chunk. Runs on the asyncio
        event loop (the target is reached through a
        :class:`~lmcache_async.rpc.client.RemoteCacheEngine`).

        Raises:
            InvalidInputError: bad tokens, ``old_position`` is not an enabled tier of this
                engine, ``new_position`` is not a (URL, tier) pair, or the target refused
                it (another namespace or chunk size, or no tier ``location``).
        """
        # The wire layer builds on the engine: import it only where a move needs it.
        from .rpc.client import RemoteCacheEngine, check_move_target  # noqa: PLC0415

        self._check_open()
        if not isinstance(old_position, str):
            raise InvalidInputError(
                f"old_position must be a tier name, got {type(old_position).__name__}"
            )
        source = self._manager.check_locations([old_position], "old_position")[0]
        url, location = check_move_target(new_position)
        if not isinstance(copy, bool):
            raise InvalidInputError(f"copy must be a bool, got {type(copy).__name__}")
        wait = self.config.remote_timeout if timeout is None else timeout
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait > 0:
            raise InvalidInputError(f"timeout must be a positive number, got {timeout!r}")
        spans, array = await self.chunk_spans(tokens)
        if not spans or array is None or not self.is_healthy():
            return 0
        try:
            async with RemoteCacheEngine.connect(
                url,
                self.layout,
                model_name=self.namespace.model_name,
                revision=self.namespace.revision,
                tenant=self.namespace.tenant_salt,
                timeout=float(wait),
                shared_memory=False,
                name=f"move-from-{self.namespace.model_name}",
            ) as target:
                if target.chunk_size != self.config.chunk_size:
                    raise InvalidInputError(
                        f"the sidecar at {url} uses chunk_size {target.chunk_size}, "
                        f"this engine {self.config.chunk_size}: their chunks do not match"
                    )
                moved = await self._push_prefix(
                    target, spans, array, source=source, location=location, copy=copy
                )
        except TierUnavailableError as exc:
            log.warning("move_target_unreachable", url=url, error=str(exc))
            return 0
        log.info(
            "prefix_moved",
            source=source,
            url=url,
            location=location,
            copy=copy,
            tokens=moved,
            asked=int(array.shape[0]),
        )
        return moved

    async def _push_prefix(
        self,
        target: RemoteCacheEngine,
        spans: list[ChunkSpan],
        tokens: np.ndarray,
        *,
        source: str,
        location: str,
        copy: bool,
    ) -> int:
        """Send the leading run of ``spans`` held by ``source`` to ``target``, batch by
        batch; returns the prefix tokens it took (removed from ``source`` unless ``copy``)."""
        keys = [span.key for span in spans]
        itemsize = self.layout.dtype.itemsize
        sizes = [math.prod(self.layout.payload_shape(s.num_tokens)) * itemsize for s in spans]
        done = 0
        while done < len(spans):
            end, total = done + 1, sizes[done]
            while end < len(spans) and total + sizes[end] <= _MOVE_BATCH_BYTES:
                total += sizes[end]
                end += 1
            objs = await self._manager.fetch_prefix(keys[done:end], (source,))
            try:
                if not objs:
                    break
                checksums = await self._checksums(objs)
                first, last = spans[done], spans[done + len(objs) - 1]
                took = await target.push_chunks(
                    tokens[: last.end],
                    [obj.tensor for obj in objs],
                    checksums=checksums,
                    start=first.start,
                    location=location,
                )
            finally:
                for obj in objs:
                    obj.unref()
            accepted = sum(1 for s in spans[done : done + len(objs)] if s.end <= first.start + took)
            if accepted and not copy:
                await self._manager.remove(keys[done : done + accepted], (source,))
            done += accepted
            if accepted < end - (done - accepted):
                break
        return spans[done - 1].end if done else 0

    async def _checksums(self, objs: Sequence[MemoryObj]) -> list[int]:
        """The payload checksum of each object (kept on it), large batches off the loop."""
        if sum(obj.nbytes for obj in objs) < _MOVE_INLINE_CHECKSUM_BYTES:
            return [object_checksum(obj) for obj in objs]
        return await anyio.to_thread.run_sync(lambda: [object_checksum(obj) for obj in objs])

    # -- chunk-level API (sidecar) --------------------------------------------------------
    # What a process that copies KV itself (the sidecar's clients) needs: the chunks of a
    # request, host memory for their payloads, and the tiers' put and fetch.

    async def chunk_spans(
        self,
        tokens: Tokens | None = None,
        *,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[list[ChunkSpan], np.ndarray | None]:
        """The chunks of a request from the mask start on, as store and retrieve cut it,
        and its tokens as int32 (None when keyed by ``hashes``). A long prompt is hashed
        in a worker thread. Raises InvalidInputError for bad input."""
        self._check_open()
        keyer, _, inline = self._keys(tokens, hashes, offsets, mask)
        if inline:
            return keyer()
        return await anyio.to_thread.run_sync(keyer)

    @property
    def key_hasher(self) -> ChunkHasher:
        """The hasher of this engine's chunk keys: a client with the same seed, algorithm
        and chunk size computes the same keys (:meth:`lookup_digests`)."""
        return self._hasher

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
                not that of its chunks, a digest is not :data:`DIGEST_SIZE` bytes, or as
                :meth:`lookup`.
        """
        self._check_open()
        locations = self._locations(search_range, "search_range")
        keys = self._digest_keys(digests, num_tokens, lookup_id=lookup_id, pin=pin)
        return await self._lookup(
            keys, [], num_tokens, lookup_id=lookup_id, pin=pin, locations=locations
        )

    def _digest_keys(
        self,
        digests: Sequence[bytes] | bytes | memoryview,
        num_tokens: int,
        *,
        lookup_id: Hashable | None,
        pin: bool,
    ) -> Sequence[bytes]:
        """The keys a lookup by chunk digests looks for, checked (see :meth:`lookup_digests`).

        Raises:
            InvalidInputError: as :meth:`lookup_digests`.
        """
        if pin and lookup_id is None:
            raise InvalidInputError("pin=True needs a lookup_id")
        if not is_strict_int(num_tokens) or num_tokens < 0:
            raise InvalidInputError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        keys: Sequence[bytes]
        if isinstance(digests, (bytes, bytearray, memoryview)):
            keys = self._frames.split(digests)  # each DIGEST_SIZE bytes by construction
        else:
            keys = digests
            # Checked with C-level maps: a 32k-token prompt has 128 digests.
            if keys and (
                not set(map(type, keys)) <= {bytes} or set(map(len, keys)) != {DIGEST_SIZE}
            ):
                raise InvalidInputError(f"every digest must be {DIGEST_SIZE} bytes")
        chunk = self.config.chunk_size
        if len(keys) != -(-num_tokens // chunk):
            raise InvalidInputError(
                f"{num_tokens} tokens make {-(-num_tokens // chunk)} chunks of {chunk},"
                f" got {len(keys)} digests"
            )
        if num_tokens % chunk and not self.config.save_unfull_chunk:
            return keys[:-1]
        return keys

    @property
    def accepts_writes(self) -> bool:
        """Whether a store could keep anything now (open, healthy, not frozen, and some
        target tier takes writes)."""
        return not self._closed and self._manager.accepts_writes and self.is_healthy()

    def hold_chunks(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """The CPU-tier payload of each key (None where absent), each referenced for the
        caller, who must ``unref()`` it."""
        self._check_open()
        return self._manager.hold(keys)

    async def allocate_chunk(self, num_tokens: int) -> MemoryObj:
        """Host memory for one chunk payload of ``num_tokens`` tokens (the layout's
        ``payload_shape`` and dtype), waiting up to ``allocation_timeout`` for room.

        Raises:
            AllocationTimeoutError: no room in time.
            InvalidInputError: ``num_tokens`` is not in ``[1, chunk_size]``.
        """
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
        """Byte offset of ``obj``'s payload in the engine's ``pool_buffer`` (or arena)."""
        return self._pool.arena_offset + obj.offset

    async def put_chunks(
        self,
        spans: Sequence[ChunkSpan],
        objs: Sequence[MemoryObj],
        tokens: np.ndarray | None = None,
        *,
        store_location: Sequence[str] | None = None,
    ) -> int:
        """Cache filled payloads as a store does (CPU tier now, slow tiers written behind
        unless configured otherwise); returns how many leading chunks a tier took. The
        caller keeps its own references. Raises InvalidInputError for an unknown tier."""
        self._check_open()
        locations = self._locations(store_location, "store_location")
        return await self._manager.put(spans, objs, tokens, locations)

    async def fetch_chunks(
        self,
        keys: Sequence[ChunkKey],
        *,
        lookup_id: Hashable | None = None,
        retrieve_locations: Sequence[str] | None = None,
    ) -> list[MemoryObj]:
        """Payloads of the leading ``keys`` cached in any tier, each referenced for the
        caller; chunks held only by disk or Redis are read into host memory, and a
        prefetch under ``lookup_id`` is waited for and used. Empty when unhealthy.
        Raises InvalidInputError for an unknown tier."""
        self._check_open()
        locations = self._locations(retrieve_locations, "retrieve_locations")
        if not self.is_healthy() or not keys:
            return []
        if lookup_id is not None:
            await self._wait_prefetch(lookup_id)
        hits = await self._manager.lookup_prefix(keys, locations)
        if not hits:
            return []
        return await self._manager.fetch_prefix(keys[:hits], locations, lookup_id)

    def record_request(self, kind: str, tokens: int, *, partial: bool = False) -> None:
        """Count a ``"store"`` or ``"retrieve"`` served through this chunk-level API in
        :meth:`stats` (``tokens`` stored or loaded).

        Raises:
            InvalidInputError: ``kind`` is neither.
        """
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

    def _locations(self, locations: Sequence[str] | None, name: str) -> tuple[str, ...] | None:
        """Validated per-call tier names, or None for the configured ones."""
        if locations is None:
            return None
        return self._manager.check_locations(locations, name)

    async def lookup_unpin(self, lookup_id: Hashable) -> None:
        """Release the pins taken by :meth:`lookup` for ``lookup_id`` (no-op if none)."""
        self._check_open()
        self._manager.unpin(lookup_id)

    async def clear(self, locations: Sequence[str] | None = None) -> int:
        """Drop every cached chunk of the named tiers (default: all) and, with the CPU tier,
        every pin; returns how many chunks were dropped."""
        self._check_open()
        return await self._manager.clear(self._locations(locations, "locations"))

    def freeze(self, enabled: bool) -> None:
        """Freeze mode: stores write nothing; lookups and retrieves are still served."""
        self._check_open()
        self._manager.freeze(enabled)

    def set_hot_cache(self, enabled: bool) -> None:
        """Switch the CPU hot cache: when off, stores keep nothing new in host memory."""
        self._check_open()
        self._manager.set_hot_cache(enabled)

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
        counters = self._counters
        tiers = self._manager.tier_stats()
        cpu = tiers[self._cpu.name]
        return EngineStats(
            pool=self._pool.stats(),
            tiers=tiers,
            store_requests=counters.store_requests,
            retrieve_requests=counters.retrieve_requests,
            lookup_requests=counters.lookup_requests,
            stored_tokens=counters.stored_tokens,
            retrieved_tokens=counters.retrieved_tokens,
            lookup_tokens=counters.lookup_tokens,
            lookup_hit_tokens=counters.lookup_hit_tokens,
            partial_stores=counters.partial_stores,
            failed_requests=counters.failed_requests,
            timed_out_requests=counters.timed_out_requests,
            cached_chunks=cpu.chunks,
            evicted_chunks=cpu.evictions,
            pinned_chunks=self._manager.pinned_chunks,
            active_lookup_ids=self._manager.active_lookup_ids,
            expired_pins=self._manager.expired_pins,
            tier_health=self._manager.tier_health(),
            tier_writes_pending=self._manager.tier_writes_pending,
            tier_writes_dropped=self._manager.tier_writes_dropped,
            tier_writes_failed=self._manager.tier_writes_failed,
            promoted_chunks=self._manager.promoted_chunks,
            tier_read_errors=self._manager.tier_read_errors,
            events_dropped=self._events.dropped,
            healthy=self.is_healthy(),
            frozen=self._manager.frozen,
            hot_cache=self._manager.hot_cache,
        )


def _check_tier_settings(config: EngineConfig) -> None:
    """Raise ConfigError when a location names a tier the config does not enable."""
    enabled = {"cpu"}
    if config.local_disk is not None:
        enabled.add("disk")
    if config.remote_url is not None:
        enabled.add("redis")
    for name in ("store_location", "retrieve_locations"):
        for tier in getattr(config, name) or ():
            if tier not in enabled:
                raise ConfigError(
                    name, f"tier {tier!r} is not enabled (set local_disk / remote_url for it)"
                )


async def open_slow_tiers(
    config: EngineConfig, pool: MemoryPool, spec: RecordSpec
) -> list[StorageBackend]:
    """Open the disk and Redis tiers the config enables, fastest first.

    Raises:
        ConfigError: a tier cannot start with its settings (the field is named).
    """
    tiers: list[StorageBackend] = []
    try:
        directory = config.disk_directory
        if directory is not None:
            tiers.append(
                await DiskBackend.open(
                    directory,
                    pool=pool,
                    spec=spec,
                    allocation_timeout=config.allocation_timeout,
                    max_local_disk_size=config.disk_capacity_bytes,
                )
            )
        if config.remote_url is not None:
            try:
                from .backends.redis import RedisBackend  # noqa: PLC0415 (optional extra)
            except ImportError as exc:
                raise ConfigError(
                    "remote_url",
                    "the Redis tier needs redis-py: pip install 'lmcache-async[redis]'",
                ) from exc
            tiers.append(
                await RedisBackend.open(
                    config.remote_url,
                    pool=pool,
                    spec=spec,
                    allocation_timeout=config.allocation_timeout,
                    timeout=config.remote_timeout,
                    ttl=config.remote_ttl,
                )
            )
    except BaseException:
        for tier in tiers:
            await tier.aclose()
        raise
    return tiers


def _check_sequence(name: str, value: object) -> Sequence[Any]:
    """``value`` itself, when it is a sequence of items (not text or bytes).

    Raises:
        InvalidInputError: it is not.
    """
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        raise InvalidInputError(f"{name} must be a sequence, got {type(value).__name__}")
    return value


def _sequence(name: str, value: object) -> list[Any]:
    """A list copy of the sequence ``value``. Raises InvalidInputError if it is not one."""
    return list(_check_sequence(name, value))


def _already_hashed(request: Request) -> Keyer:
    spans, tokens = request.spans, request.tokens
    return lambda: (spans, tokens)


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
