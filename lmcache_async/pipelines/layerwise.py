"""Layerwise store and retrieve: one step per layer of the serving engine's forward pass.

A layerwise request moves each chunk as one ``KV_T2D`` payload per layer (``[tokens, 2,
heads * head_size]``, ``[tokens, latent]`` for MLA) under the key ``span.key.with_layer(i)``,
so the serving engine can overlap layer *i*'s transfer with the compute of the next layer.
Both directions are async generators of exactly ``num_layers + 1`` steps, whatever happens
(a miss, a failure, a frozen cache: the steps are then no-ops), so the engine's loop never
has to special-case them:

* **store** (``await anext(it)`` once after each layer's compute, once more at the end):
  step 0 hashes the request, takes the chunks already cached, allocates the payloads of the
  others and starts layer 0's gather; step *i* starts layer *i*'s gather (on CUDA it is
  queued behind layer *i*'s compute) and finishes layer *i-1*'s; step ``num_layers``
  finishes the last layer, puts every chunk (all its layers present) into the cache and
  yields the number of tokens stored. The earlier steps yield ``None``.
* **retrieve** (``await anext(it)`` once before layer 0's compute, then once before each
  layer's compute): step 0 looks up the chunks whose every layer is cached and takes
  references on them; step *i + 1* returns once layer *i* has been written into the
  engine's KV memory (on CUDA layer *i + 1* is already queued behind it). The last step
  yields the bool mask (CPU) of the tokens loaded; the earlier ones yield ``None``.

On the CPU a step runs its copy then and there (inline when small, in copy threads when
large, as :class:`~lmcache_async.transfer.cuda.Transfers` decides), so no copy runs ahead of the
step that asks for it. On CUDA one copy runs ahead on the direction's stream, ordered
against the caller's stream (:mod:`lmcache_async.transfer.cuda_streams`): a store step's copy comes
after what the caller queued there before the step (that layer's compute); a load's
layer comes after the request's point on it, and is the caller's once the step that waited
for it returns (what the caller queues then runs after the copy has completed).

Closing an iterator early (``aclose()``, leaving an ``async for``, cancelling the task that
drives it) waits for copies already queued and returns every byte of host memory and every
reference it took. Layer keys never collide with whole-chunk keys: a prefix stored one way
is a miss for the other way, never wrong bytes.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from lmcache_async.keys.chunks import ChunkSpan
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import MemoryObj
from lmcache_async.transfer.cuda import CallerStream, Direction, Transfers, wait_out

from ..backends.manager import StorageManager
from ..core import LoadCore, StoreCore, StoreTxn
from ..core.copy import mark_loaded
from ..core.store import layer_keys, release
from ..errors import EngineClosedError
from ..layouts import KVLayout
from ..stats import Counters
from .common import Request, compute_spans

__all__ = [
    "LayerwisePipeline",
    "RetrieveLayers",
    "StoreLayers",
    "layer_keys",
]

log = get_logger(__name__)

StoreLayers = AsyncGenerator[int | None, None]
"""A layerwise store: ``num_layers`` steps yield None, the last yields the tokens stored."""
RetrieveLayers = AsyncGenerator[torch.Tensor | None, None]
"""A layerwise retrieve: ``num_layers`` steps yield None, the last the bool mask (CPU)."""

# (start, end, payload) of one chunk in one layer.
_Job = tuple[int, int, torch.Tensor]


class _Copies:
    """The layer copies of one request: run at once on the CPU, queued ahead on CUDA.

    On CUDA :meth:`start` queues the copy on the direction's stream (a task that awaits its
    completion event) and returns; :meth:`finish` awaits it. On the CPU :meth:`start` runs
    the copy and :meth:`finish` has nothing left to do. ``caller`` is the request's point
    on the caller's stream (None on the CPU); a store's step marks a new one.
    """

    def __init__(
        self,
        transfers: Transfers,
        device: torch.device,
        direction: Direction,
        timeout: float,
        caller: CallerStream | None,
    ) -> None:
        self._transfers = transfers
        self._device = device
        self._direction = direction
        self._timeout = timeout
        self._caller = caller
        self._tasks: dict[int, asyncio.Task[None]] = {}

    @property
    def ahead(self) -> bool:
        """Whether a copy may run ahead of the step that needs it (CUDA streams)."""
        return self._device.type == "cuda"

    async def start(
        self, layer: int, work: Callable[[list[_Job]], None], jobs: list[_Job], nbytes: int
    ) -> None:
        caller = self._caller
        if caller is not None:
            # A store's layer: now, after the caller's compute of it. A load's: the
            # request's point; the step that waits for the layer hands it over.
            store = self._direction is Direction.STORE
            caller = caller.mark() if store else caller.handed_over()
        copy = self._transfers.run(
            work,
            jobs,
            device=self._device,
            direction=self._direction,
            nbytes=nbytes,
            timeout=self._timeout,
            caller=caller,
        )
        if not self.ahead:
            await copy
            return
        self._tasks[layer] = asyncio.ensure_future(copy)
        # One loop turn: the task queues its copy on the stream before this step returns.
        await asyncio.sleep(0)

    async def finish(self, layer: int) -> None:
        """Wait for layer ``layer``'s copy; re-raises its failure."""
        task = self._tasks.get(layer)
        if task is None:
            return
        # Shielded: cancelling the caller must not cancel the wait for a copy still on the
        # device; drain() waits for it before the memory is released.
        await asyncio.shield(task)
        del self._tasks[layer]

    async def drain(self) -> None:
        """Wait for every copy still queued, ignoring failures (used when closing).

        Not interrupted by cancellation: the memory the copies touch is released next.
        The cancellation is re-raised once they are done.
        """
        tasks = list(self._tasks.values())
        self._tasks.clear()
        try:
            await wait_out(tasks)
        finally:
            for task in tasks:
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: a failure while closing is not news


@dataclass(eq=False, slots=True)
class _Payloads:
    """Per-layer payloads of the chunks a request copies: ``objs[layer][i]`` belongs to
    ``spans[i]``. ``held`` are references on cached payloads kept until the request ends."""

    spans: list[ChunkSpan] = field(default_factory=list)
    objs: list[list[MemoryObj]] = field(default_factory=list)
    held: list[MemoryObj] = field(default_factory=list)

    def jobs(self, layer: int) -> tuple[list[_Job], int]:
        """The copy jobs of one layer and their bytes."""
        objs = self.objs[layer]
        jobs = [
            (span.start, span.end, obj.tensor) for span, obj in zip(self.spans, objs, strict=True)
        ]
        return jobs, sum(obj.nbytes for obj in objs)

    def release_layer(self, layer: int) -> None:
        release(self.objs[layer])
        self.objs[layer] = []

    def release(self) -> None:
        for layer in range(len(self.objs)):
            self.release_layer(layer)
        release(self.held)
        self.held.clear()


class LayerwisePipeline:
    """Builds the layerwise store and retrieve iterators of one engine.

    Its stores and loads run the request core's phases (``store``, ``load``) with one
    payload per layer of each chunk; the storage manager answers its layer lookups. It has
    no tasks of its own, so there is nothing to start or stop.
    """

    def __init__(
        self,
        manager: StorageManager,
        store: StoreCore,
        load: LoadCore,
        layout: KVLayout,
        transfers: Transfers,
        *,
        counters: Counters,
        healthy: Callable[[], bool],
        store_timeout: float,
        retrieve_timeout: float,
        remove_after_retrieve: bool = False,
    ) -> None:
        self._healthy = healthy
        self._manager = manager
        self._store = store
        self._load = load
        self._layout = layout
        self._transfers = transfers
        self._counters = counters
        self._store_timeout = store_timeout
        self._retrieve_timeout = retrieve_timeout
        self._remove_after_retrieve = remove_after_retrieve

    @property
    def num_layers(self) -> int:
        return self._layout.num_layers

    # -- lookups --------------------------------------------------------------------------

    async def lookup(self, keys: Sequence[bytes], locations: Sequence[str] | None = None) -> int:
        """Number of leading chunks of ``keys`` whose every layer is cached.

        The per-layer payloads of a chunk are put together, after all of them were copied;
        eviction can still drop some layers of a chunk, so every layer key is checked.
        """
        found = await self._manager.lookup_prefix(layer_keys(keys, self.num_layers), locations)
        return found // self.num_layers

    def pin(self, keys: Sequence[bytes], lookup_id: Hashable) -> int:
        """Pin every layer of the leading cached chunks of ``keys`` for ``lookup_id``;
        returns the number of chunks whose every layer is now pinned."""
        return self._manager.pin_prefix(layer_keys(keys, self.num_layers), lookup_id) // (
            self.num_layers
        )

    # -- store ----------------------------------------------------------------------------

    async def store(self, request: Request, *, limit: int, accepted: bool) -> StoreLayers:
        """The layerwise store of ``request`` (see the module docstring for the steps).

        No chunk ending after token ``limit`` is stored; ``accepted``: whether the cache
        took the store (:meth:`StoreCore.open`). The last step yields the number of tokens,
        from the first stored chunk on, whose chunks (every layer) are cached then: fewer
        than asked after a partial store (no host memory in time), 0 when the cache takes
        no writes, the engine is unhealthy or a copy failed.
        """
        core = self._store
        num_layers = self.num_layers
        payloads = _Payloads()
        copies = _Copies(
            self._transfers,
            request.device,
            Direction.STORE,
            self._store_timeout,
            request.caller_stream,
        )
        txn: StoreTxn | None = None
        try:
            if accepted:
                txn = await self._begin_store(request, limit, payloads)
            ok = txn is not None
            gather = request.plan.gather_layer_chunks
            for layer in range(num_layers):
                if ok and payloads.spans:
                    jobs, nbytes = payloads.jobs(layer)
                    ok = await self._guard(
                        request, copies.start(layer, functools.partial(gather, layer), jobs, nbytes)
                    )
                    if ok and layer:
                        ok = await self._guard(request, copies.finish(layer - 1))
                yield None
            if ok and payloads.spans:
                ok = await self._guard(request, copies.finish(num_layers - 1))
            stored = 0
            if txn is not None:
                if ok and payloads.spans:
                    ok = await self._commit(request, txn, payloads)
                stored = core.finish(txn) if ok else core.abort(txn)
            yield stored
        finally:
            try:
                await copies.drain()
            finally:
                payloads.release()
                if txn is not None:
                    core.abort(txn)  # a store closed early: nothing counted, all returned

    async def _begin_store(
        self, request: Request, limit: int, payloads: _Payloads
    ) -> StoreTxn | None:
        """Hash, then begin the store with the core (chunks already cached, every layer,
        are held) and reserve the others' payloads; None if nothing may be stored.
        Invalid tokens (found off the loop) raise InvalidInputError."""
        await compute_spans(request)  # invalid tokens found off the loop raise here
        core, num_layers = self._store, self.num_layers
        txn = core.begin(
            request.req_id,
            request.spans,
            request.tokens,
            limit=limit,
            locations=request.locations,
            layers=num_layers,
        )
        try:
            objs = await core.reserve(txn, txn.todo)
        except Exception:
            core.abort(txn)
            self._fail(request, "layerwise_allocate_failed")
            return None
        payloads.spans = [txn.spans[index] for index in txn.todo[: len(objs) // num_layers]]
        payloads.objs = [objs[layer::num_layers] for layer in range(num_layers)]
        return txn

    async def _commit(self, request: Request, txn: StoreTxn, payloads: _Payloads) -> bool:
        """Commit every layer of the copied chunks with the core (their payloads go back);
        False when the commit failed. An unhealthy engine commits nothing (the chunks
        already cached still count)."""
        num_layers = self.num_layers
        count = len(payloads.spans)
        objs = [payloads.objs[layer][i] for i in range(count) for layer in range(num_layers)]
        payloads.objs = [[] for _ in range(num_layers)]
        if not self._healthy():
            release(objs)
            return True
        return await self._guard(request, self._store.commit(txn, txn.todo[:count], objs))

    # -- retrieve -------------------------------------------------------------------------

    async def retrieve(self, request: Request, *, lookup_id: Hashable | None) -> RetrieveLayers:
        """The layerwise retrieve of ``request`` (see the module docstring for the steps).

        The last step yields a bool CPU tensor of ``request.num_tokens``: True exactly for
        the tokens whose KV was written in every layer. After a failed copy it is all False
        (the layers already written are recomputed by the engine). Pins held for
        ``lookup_id`` are released when the iterator ends.
        """
        num_layers = self.num_layers
        mask = torch.zeros(request.num_tokens, dtype=torch.bool)
        payloads = _Payloads()
        copies = _Copies(
            self._transfers,
            request.device,
            Direction.LOAD,
            self._retrieve_timeout,
            request.caller_stream,
        )
        scatter = request.plan.scatter_layer_chunks
        loaded = 0
        try:
            ok = await self._load.begin(lookup_id) and await self._begin_retrieve(request, payloads)

            async def start(layer: int) -> None:
                jobs, nbytes = payloads.jobs(layer)
                await copies.start(layer, functools.partial(scatter, layer), jobs, nbytes)

            if ok and copies.ahead:
                ok = await self._guard(request, start(0))
            yield None
            for layer in range(num_layers):
                if ok and copies.ahead:
                    if layer + 1 < num_layers:
                        ok = await self._guard(request, start(layer + 1))
                    ok = ok and await self._guard(request, copies.finish(layer))
                elif ok:
                    ok = await self._guard(request, start(layer))
                if ok:
                    payloads.release_layer(layer)
                if layer + 1 < num_layers:
                    yield None
            if ok:
                self._mark(request, payloads.spans, mask)
                if self._remove_after_retrieve:
                    await self._remove_loaded(request, payloads.spans, mask)
            loaded = int(mask.sum())
            yield mask
        finally:
            try:
                await copies.drain()
            finally:
                payloads.release()
                self._load.finish(lookup_id, loaded)

    async def _begin_retrieve(self, request: Request, payloads: _Payloads) -> bool:
        """Hash and reserve every layer of the leading cached chunks with the load core;
        False on a miss."""
        await compute_spans(request)  # invalid tokens found off the loop raise here
        num_layers = self.num_layers
        spans = request.spans
        keys = layer_keys([span.key for span in spans], num_layers)
        try:
            found = await self._load.reserve(keys, request.locations, request.lookup_id)
        except Exception:
            self._fail(request, "layerwise_lookup_failed")
            return False
        hits = len(found) // num_layers
        release(found[hits * num_layers :])  # a chunk missing a layer is a miss
        payloads.spans = spans[:hits]
        payloads.objs = [
            found[layer : hits * num_layers : num_layers] for layer in range(num_layers)
        ]
        return hits > 0

    async def _remove_loaded(
        self, request: Request, spans: list[ChunkSpan], mask: torch.Tensor
    ) -> None:
        """Remove every layer of the chunks loaded (the receiver role of disaggregated
        prefill); a failure is logged, the loaded KV stays good."""
        loaded = [span.key for span in spans if mask[span.end - 1]]
        if not loaded:
            return
        try:
            await self._load.remove(layer_keys(loaded, self.num_layers))
        except Exception:
            log.exception("layerwise_remove_failed", req_id=request.req_id)

    @staticmethod
    def _mark(request: Request, spans: list[ChunkSpan], mask: torch.Tensor) -> None:
        """Mark the tokens of ``spans`` (consecutive) that were written (slot >= 0)."""
        if spans:
            mark_loaded(mask, request.plan, request.slots_cpu, spans[0].start, spans[-1].end)

    # -- failures -------------------------------------------------------------------------

    async def _guard(self, request: Request, step: Awaitable[object]) -> bool:
        """Await ``step``; a failure is logged and counted, and ends the request's work (its
        remaining steps are no-ops). Returns whether it succeeded."""
        try:
            await step
        except EngineClosedError:
            # The engine closed under a request the serving engine is still stepping.
            log.warning("layerwise_engine_closed", req_id=request.req_id)
            return False
        except Exception:
            self._fail(request, "layerwise_step_failed")
            return False
        return True

    def _fail(self, request: Request, event: str) -> None:
        self._counters.failed_requests += 1
        log.exception(event, req_id=request.req_id)
