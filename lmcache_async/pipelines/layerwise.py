"""Layerwise store and retrieve: one step per layer of the serving engine's forward pass.

A layerwise request moves each chunk as one ``KV_T2D`` payload per layer (``[tokens, 2,
heads * head_size]``, ``[tokens, latent]`` for MLA) under the key ``span.key.with_layer(i)``,
so the serving engine can overlap layer *i*'s transfer with the compute of the next layer.
Both directions are async generators of exactly ``num_layers + 1`` steps, whatever happens
(a miss, a failure, a frozen cache: the steps are then no-ops), so the engine's loop never
has to special-case them:

* **store** (``await anext(it)`` once after each layer's compute, once more at the end):
  step 0 hashes the request, takes the chunks already cached, allocates the payloads of the
  others (each layer's payloads of consecutive chunks one after the other in the pool) and
  starts layer 0's gather; step *i* starts layer *i*'s gather (on CUDA it is queued behind
  layer *i*'s compute and not waited for: it crosses the link while the caller computes
  the next layers); step ``num_layers`` waits for every layer's copy, puts every chunk
  (all its layers present) into the cache and yields the number of tokens stored. The
  earlier steps yield ``None``.
* **retrieve** (``await anext(it)`` once before layer 0's compute, then once before each
  layer's compute): step 0 looks up the chunks whose every layer is cached, takes
  references on them and (on CUDA) queues layer 0's copy; step *i + 1* makes layer *i*
  the caller's: on the CPU it returns once layer *i* has been written into the engine's
  KV memory; on CUDA it makes the caller's stream wait for layer *i*'s copy on the device
  (``wait_event``), queues layer *i + 1*'s and returns without waiting on the host, so the
  caller's compute of layer *i* is queued while layer *i + 1* crosses the link. The last
  step waits for every copy and yields the bool mask (CPU) of the tokens loaded; the
  earlier ones yield ``None``.

On the CPU a step runs its copy then and there (inline when small, in copy threads when
large, as :class:`~lmcache_async.transfer.cuda.Transfers` decides), so no copy runs ahead
of the step that asks for it. On CUDA the copies run ahead on the direction's stream,
ordered against the caller's stream (:mod:`lmcache_async.transfer.cuda_streams`): a store
step's copy comes after what the caller queued there before the step (that layer's
compute); a load's layer comes after the request's point on it, and the caller's stream
after the layer from the step that hands it over. Each layer moves staged
(:mod:`lmcache_async.transfer.layer_staged`): one kernel, and one host copy per run of
payloads adjacent in the pool. Completion still reaches the event loop through the copy
stream's events: a load's payloads go back to the pool as each layer completes.

Closing an iterator early (``aclose()``, leaving an ``async for``, cancelling the task that
drives it) waits for copies already queued and returns every byte of host memory and every
reference it took. Layer keys never collide with whole-chunk keys: a prefix stored one way
is a miss for the other way, never wrong bytes.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from lmcache_async.keys.chunks import ChunkSpan
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import MemoryObj
from lmcache_async.transfer.cuda import Direction, Transfers
from lmcache_async.transfer.layer_copies import LayerCopies
from lmcache_async.transfer.layer_staged import StagedLayers

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


def _layer_major(
    spans: Sequence[ChunkSpan], objs: Sequence[MemoryObj], num_layers: int
) -> list[list[MemoryObj]]:
    """Deal the payloads a store reserved (chunk-major: ``objs[i * num_layers + layer]``
    was allocated for chunk ``i``) out layer-major among chunks of one length, which take
    payloads of one shape: ``result[layer][i]`` is then the ``layer * n + j``-th of their
    allocations (chunk ``i`` the ``j``-th of ``n``). Allocations made one after the other
    lie back to back in the pool, so each layer's payloads of consecutive chunks usually
    do too, and a layer crosses the link in one copy
    (:mod:`lmcache_async.transfer.layer_staged`)."""
    groups: dict[int, list[int]] = {}
    for i, span in enumerate(spans):
        groups.setdefault(span.end - span.start, []).append(i)
    dealt: dict[tuple[int, int], MemoryObj] = {}
    for positions in groups.values():
        taken = [objs[i * num_layers + layer] for i in positions for layer in range(num_layers)]
        count = len(positions)
        for layer in range(num_layers):
            for j, i in enumerate(positions):
                dealt[layer, i] = taken[layer * count + j]
    return [[dealt[layer, i] for i in range(len(spans))] for layer in range(num_layers)]


class _LayerWork:
    """Each layer's copy of one request: the plan's per-layer copies on the CPU (the C row
    copies); on CUDA staged (:class:`~lmcache_async.transfer.layer_staged.StagedLayers`,
    built on the first layer), one kernel and one host copy per run of adjacent payloads
    per layer."""

    def __init__(
        self, transfers: Transfers, request: Request, payloads: _Payloads, direction: Direction
    ) -> None:
        self._transfers = transfers
        self._request = request
        self._payloads = payloads
        self._direction = direction
        self._staged: StagedLayers | None = None

    def __call__(self, layer: int) -> Callable[[list[_Job]], None]:
        """Layer ``layer``'s copy, a function of the layer's jobs.

        Raises:
            InvalidInputError: a chunk's range is out of the request (CUDA).
            EngineClosedError: the transfers were closed (CUDA).
        """
        plan, store = self._request.plan, self._direction is Direction.STORE
        staging = self._transfers.staging(self._request.device, self._direction)
        if staging is None:
            per_layer = plan.gather_layer_chunks if store else plan.scatter_layer_chunks
            return functools.partial(per_layer, layer)
        if self._staged is None:
            ranges = [(span.start, span.end) for span in self._payloads.spans]
            self._staged = StagedLayers(plan, ranges)
        staged = self._staged.gather if store else self._staged.scatter
        return functools.partial(staged, layer, staging=staging)


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
        copies = LayerCopies(
            self._transfers,
            request.device,
            Direction.STORE,
            self._store_timeout,
            request.caller_stream,
        )
        txn: StoreTxn | None = None
        work = _LayerWork(self._transfers, request, payloads, Direction.STORE)

        async def start(layer: int) -> None:
            jobs, nbytes = payloads.jobs(layer)
            await copies.start(layer, work(layer), jobs, nbytes)

        try:
            if accepted:
                txn = await self._begin_store(request, limit, payloads)
            ok = txn is not None
            for layer in range(num_layers):
                # On CUDA queued behind the caller's compute of this layer, not waited
                # for: it crosses the link while the caller computes the next layers.
                if ok and payloads.spans:
                    ok = await self._guard(request, start(layer))
                yield None
            if ok and payloads.spans:
                ok = await self._guard(request, copies.finish())
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
        payloads.objs = _layer_major(payloads.spans, objs, num_layers)
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
        copies = LayerCopies(
            self._transfers,
            request.device,
            Direction.LOAD,
            self._retrieve_timeout,
            request.caller_stream,
        )
        work = _LayerWork(self._transfers, request, payloads, Direction.LOAD)
        loaded = 0

        async def start(layer: int) -> None:
            jobs, nbytes = payloads.jobs(layer)
            done = functools.partial(payloads.release_layer, layer)
            await copies.start(layer, work(layer), jobs, nbytes, done)

        async def hand_over(layer: int) -> None:
            copies.hand_over(layer)

        try:
            ok = await self._load.begin(lookup_id) and await self._begin_retrieve(request, payloads)
            if ok and copies.ahead:
                ok = await self._guard(request, start(0))
            yield None
            for layer in range(num_layers):
                if copies.ahead:
                    # The caller's stream waits for layer i on the device (every layer
                    # queued is handed over, even after a failure: the caller's next
                    # kernels must not race its copy), layer i + 1 is queued, and the
                    # step returns without waiting for either on the host.
                    handed = await self._guard(request, hand_over(layer))
                    ok = ok and handed
                    if ok and layer + 1 < num_layers:
                        ok = await self._guard(request, start(layer + 1))
                elif ok:
                    ok = await self._guard(request, start(layer))
                if layer + 1 < num_layers:
                    yield None
            if ok and copies.ahead:
                ok = await self._guard(request, copies.finish())
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
