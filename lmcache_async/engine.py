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
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import numpy as np
import structlog
import torch
from anyio import CancelScope
from anyio.abc import TaskStatus

from .backends.cpu import CPUBackend
from .backends.manager import StorageManager
from .config import EngineConfig
from .cuda import Transfers
from .errors import ConfigError, EngineClosedError, InvalidInputError
from .events import EventBuffer, KVEvent
from .keys import ChunkHasher, ChunkSpan, HashAlgorithm, Namespace, check_mask, token_array
from .layouts import KVLayout
from .memory import MemoryPool
from .pipelines.common import Keyer, Request
from .pipelines.retrieve import RetrieveRequest, build_retrieve_stages
from .pipelines.stage import Completion, Pipeline
from .pipelines.store import StoreRequest, build_store_stages
from .stats import Counters, EngineStats

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
        self._events = EventBuffer(config.max_kv_events, enabled=config.enable_kv_events)
        self._pool = MemoryPool(config.cpu_capacity_bytes)
        chunk_bytes = math.prod(layout.payload_shape(config.chunk_size)) * layout.dtype.itemsize
        if chunk_bytes > self._pool.capacity_bytes:
            raise ConfigError(
                "max_local_cpu_size",
                f"{config.max_local_cpu_size} GB holds less than one chunk of this layout "
                f"({chunk_bytes} bytes for {config.chunk_size} tokens)",
            )
        self._cpu = CPUBackend(self._pool)
        self._manager = StorageManager(
            self._cpu,
            events=self._events,
            chunk_size=config.chunk_size,
            pin_timeout=config.pin_timeout,
            hot_cache=config.local_cpu,
        )
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
    ) -> _EngineContext:
        """An async context manager that yields a running engine and closes it on exit.

        ``model_name``, ``revision`` (weights fingerprint) and ``tenant`` (a salt) go into
        every chunk key with the layout's fingerprint, so caches of different models,
        weights, layouts or tenants never mix. Raises InvalidInputError for a bad argument.
        """
        if not isinstance(config, EngineConfig):
            raise InvalidInputError("config must be an EngineConfig")
        if not isinstance(layout, KVLayout):
            raise InvalidInputError("layout must be a KVLayout")
        if not isinstance(model_name, str) or not model_name:
            raise InvalidInputError("model_name must be a non-empty string")
        return _EngineContext(
            cls(config, layout, model_name=model_name, revision=revision, tenant=tenant)
        )

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        await stack.enter_async_context(self._store_pipe)
        await stack.enter_async_context(self._retrieve_pipe)
        task_group = await stack.enter_async_context(anyio.create_task_group())
        await task_group.start(self._reap_pins, name="pin-reaper")
        self._started = True
        log.info(
            "engine_started",
            model=self.namespace.model_name,
            layout=self.layout.fingerprint,
            cpu_bytes=self._pool.capacity_bytes,
            chunk_size=self.config.chunk_size,
        )

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
        # Joining the copy and bridge threads blocks: do it off the event loop, and finish
        # it even when the closing task is being cancelled.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._transfers.close)
        await self._manager.aclose()
        self._pool.close()
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
        given: object = kv_caches  # checked at run time: callers are not type-checked
        if isinstance(given, torch.Tensor) or not isinstance(given, Sequence):
            raise InvalidInputError("kv_caches must be a list of per-layer tensors")
        if not isinstance(slot_mapping, torch.Tensor):
            raise InvalidInputError("slot_mapping must be a 1-D integer tensor")
        num_blocks = self.layout.check_kv_caches(kv_caches)
        slots = self.layout.check_slot_mapping(slot_mapping, num_tokens, num_blocks)
        slots_cpu = slots if slots.device.type == "cpu" else slots.cpu()
        request = request_type(
            req_id=req_id if req_id is not None else f"req-{next(self._request_ids)}",
            keyer=keyer,
            num_tokens=num_tokens,
            hash_inline=inline,
            plan=self.layout.plan(kv_caches, slots, slots_cpu=slots_cpu),
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
        or it is unhealthy. Raises InvalidInputError (nothing stored) for bad input.
        """
        self._check_open()
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
        self._counters.store_requests += 1
        if not self._manager.accepts_writes or not self.is_healthy():
            return 0
        skipped = request.plan.first_skipped(start)
        request.limit = request.num_tokens if skipped is None else skipped
        stored = await self._execute(
            self._store_pipe, request, request.completion, self.config.store_timeout
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
    ) -> torch.Tensor:
        """Load the cached KV of the longest cached run of chunks from the mask start on.

        Returns a bool CPU tensor of ``len(tokens)``: True exactly for the tokens whose KV
        was written into ``kv_caches``; nothing outside it is written, and tokens with a
        negative slot are never written. Pins held for ``lookup_id`` are released when it
        finishes. Raises InvalidInputError for bad input.
        """
        self._check_open()
        try:
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
            self._counters.retrieve_requests += 1
            request.mask = torch.zeros(request.num_tokens, dtype=torch.bool)
            if not self.is_healthy():
                return request.mask
            result = await self._execute(
                self._retrieve_pipe, request, request.completion, self.config.retrieve_timeout
            )
            self._counters.retrieved_tokens += request.loaded_tokens
            if result is not None:
                return result
            # Timed out or failed: a snapshot, in case an abandoned copy still lands later.
            return request.mask.clone()
        finally:
            if lookup_id is not None:
                self._manager.unpin(lookup_id)

    async def _execute(
        self, pipeline: Pipeline, request: Request, completion: Completion[T], timeout: float
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

    async def lookup(
        self,
        tokens: Tokens | None = None,
        *,
        lookup_id: Hashable | None = None,
        pin: bool = False,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
    ) -> int:
        """Number of prefix tokens (from token 0) whose KV is cached.

        With ``pin=True`` and a ``lookup_id`` those chunks are pinned (never evicted) until
        :meth:`lookup_unpin`, a :meth:`retrieve` with the same id, or ``pin_timeout``.
        Raises InvalidInputError for bad input.
        """
        self._check_open()
        if pin and lookup_id is None:
            raise InvalidInputError("pin=True needs a lookup_id")
        chunk_size = self.config.chunk_size
        if hashes is not None:
            keyer, num_tokens, _ = self._keys(tokens, hashes, offsets, None)
            spans, _ = keyer()
            keys: Sequence[bytes] = [span.key for span in spans]
            ends = [span.end for span in spans]
        else:
            # Only the digests are needed: a whole-chunk key is its digest.
            if tokens is None:
                raise InvalidInputError("tokens (or hashes with offsets) are required")
            _, num_tokens, inline = self._keys(tokens, None, offsets, None)
            digest = functools.partial(self._hasher.digests, tokens)
            if inline:
                keys = digest()
            else:
                # A long prompt asked about again is recognised here, without a thread hop.
                remembered = self._hasher.remembered(tokens)
                keys = (
                    remembered if remembered is not None else await anyio.to_thread.run_sync(digest)
                )
            if num_tokens % chunk_size and not self.config.save_unfull_chunk:
                keys = keys[:-1]
            ends = []
        self._counters.lookup_requests += 1
        self._counters.lookup_tokens += num_tokens
        if not self.is_healthy():
            return 0
        if pin and lookup_id is not None:
            hits = self._manager.pin_prefix(keys, lookup_id)
            self._pins_changed.set()
        else:
            hits = self._manager.contains_prefix(keys)
        if not hits:
            hit_tokens = 0
        elif ends:
            hit_tokens = ends[hits - 1]
        else:
            hit_tokens = min(hits * chunk_size, num_tokens)
        self._counters.lookup_hit_tokens += hit_tokens
        return hit_tokens

    async def lookup_unpin(self, lookup_id: Hashable) -> None:
        """Release the pins taken by :meth:`lookup` for ``lookup_id`` (no-op if none)."""
        self._check_open()
        self._manager.unpin(lookup_id)

    async def clear(self) -> int:
        """Drop every cached chunk and every pin; returns how many chunks were dropped."""
        self._check_open()
        return self._manager.clear()

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
            events_dropped=self._events.dropped,
            healthy=self.is_healthy(),
            frozen=self._manager.frozen,
            hot_cache=self._manager.hot_cache,
        )


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
