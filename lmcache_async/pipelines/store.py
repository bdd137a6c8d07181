"""The store pipeline: hash → allocate → D2H copy → put.

Each request is cut into batches of chunks; a batch moves through the stages on its own, so
the copy of batch *i+1* overlaps the put of batch *i* and many requests share the stages.
A request resolves to the number of tokens, from its first stored chunk on, whose chunks are
cached when it finishes. When host memory cannot be had in time the request stores the
prefix it has (a partial store) and drops the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..backends.manager import StorageManager
from ..cuda import Direction, Transfers
from ..errors import AllocationTimeoutError
from ..layouts import KVLayout
from ..memory import MemoryObj, MemoryPool
from .common import Request, batched, compute_spans, release
from .stage import Completion, Emit, drive

__all__ = ["StoreBatch", "StoreRequest", "build_store_stages"]

log = structlog.get_logger(__name__)


@dataclass(eq=False, slots=True)
class StoreRequest(Request):
    """A store in flight. ``limit``: no chunk ending after this token index is stored.

    The request holds a reference on every chunk it counts as cached (found present, or
    put by one of its batches) until it finishes, so its own later allocations cannot
    evict its prefix: memory pressure makes it a shorter store, never a store with a hole.
    It resolves only when every batch is accounted for, so nothing of it is still running
    when the caller gets the answer.
    """

    limit: int = 0
    completion: Completion[int] = field(default_factory=Completion)
    stored: list[bool] = field(default_factory=list)
    partial: bool = False
    error: BaseException | None = None
    held: list[MemoryObj] = field(default_factory=list)

    @property
    def dropping(self) -> bool:
        """True when no further batch of this request may be copied or put."""
        return self.cancelled or self.error is not None

    def stored_tokens(self) -> int:
        """Tokens covered by the leading run of chunks that are cached."""
        end = self.spans[0].start if self.spans else 0
        for span, ok in zip(self.spans, self.stored, strict=False):
            if not ok:
                break
            end = span.end
        return end - (self.spans[0].start if self.spans else 0)

    def finish_batch(self) -> None:
        self.batches_done += 1
        if self.batches_done == self.batches_total:
            self.finish()

    def finish(self) -> None:
        """Resolve the request and drop the references it held."""
        release(self.held)
        self.held.clear()
        if self.error is not None:
            self.completion.set_error(self.error)
        else:
            self.completion.set_result(self.stored_tokens())

    def fail(self, error: BaseException) -> None:
        """Record the first failure; the remaining batches are dropped."""
        self.stopped = True
        if self.error is None:
            self.error = error


@dataclass(eq=False, slots=True)
class StoreBatch:
    request: StoreRequest
    indices: list[int]  # positions in request.spans
    objs: list[MemoryObj] = field(default_factory=list)


class HashStage:
    """Cuts a request into chunk keys, skips chunks already cached, emits batches."""

    name = "store-hash"

    def __init__(self, manager: StorageManager, *, batch_chunks: int) -> None:
        self._manager = manager
        self._batch_chunks = batch_chunks

    async def run(
        self,
        receive: MemoryObjectReceiveStream[StoreRequest],
        send: MemoryObjectSendStream[StoreBatch],
    ) -> None:
        await drive(self, receive, send)

    async def handle(self, request: StoreRequest, emit: Emit) -> None:
        if request.skip:
            request.finish()
            return
        try:
            await compute_spans(request)
        except Exception as exc:  # invalid tokens found off the loop
            request.fail(exc)
            request.finish()
            return
        spans = [span for span in request.spans if span.end <= request.limit]
        request.spans = spans
        present = self._manager.hold([span.key for span in spans])
        request.stored = [obj is not None for obj in present]
        request.held = [obj for obj in present if obj is not None]
        todo = [i for i, obj in enumerate(present) if obj is None]
        groups = batched(0, len(todo), self._batch_chunks)
        request.batches_total = len(groups)
        if not groups:
            request.finish()
            return
        for group in groups:
            await emit(StoreBatch(request, [todo[i] for i in group]))


class AllocateStage:
    """Takes host memory for each chunk of a batch, waiting (bounded) for space."""

    name = "store-allocate"

    def __init__(self, pool: MemoryPool, layout: KVLayout, *, timeout: float) -> None:
        self._pool = pool
        self._layout = layout
        self._timeout = timeout

    async def run(
        self,
        receive: MemoryObjectReceiveStream[StoreBatch],
        send: MemoryObjectSendStream[StoreBatch],
    ) -> None:
        await drive(self, receive, send)

    async def handle(self, batch: StoreBatch, emit: Emit) -> None:
        request = batch.request
        if request.skip:
            request.finish_batch()
            return
        try:
            await self._allocate(batch)
        except Exception as exc:
            release(batch.objs)
            request.fail(exc)
            request.finish_batch()
            return
        except BaseException:  # run inline: the caller was cancelled while it waited
            release(batch.objs)
            request.stopped = True
            request.finish_batch()
            raise
        if not batch.objs:
            request.finish_batch()
            return
        await emit(batch)

    async def _allocate(self, batch: StoreBatch) -> None:
        request = batch.request
        dtype = self._layout.dtype
        for index in batch.indices:
            span = request.spans[index]
            shape = self._layout.payload_shape(span.num_tokens)
            obj = self._pool.allocate_nowait(shape, dtype)
            if obj is None:
                try:
                    with anyio.CancelScope() as request.waiting:
                        if request.cancelled:
                            request.waiting.cancel()
                        obj = await self._pool.allocate(shape, dtype, timeout=self._timeout)
                    request.waiting = None
                    if obj is None:  # the request was cancelled while waiting
                        break
                except AllocationTimeoutError:
                    request.waiting = None
                    request.stopped = True
                    request.partial = True
                    log.warning(
                        "store_partial",
                        req_id=request.req_id,
                        stored_chunks=index,
                        chunks=len(request.spans),
                        reason="host_memory_timeout",
                    )
                    break
            batch.objs.append(obj)
        del batch.indices[len(batch.objs) :]


class CopyStage:
    """Gathers each chunk's KV out of the engine's memory into its host payload (D2H)."""

    name = "store-copy"

    def __init__(self, transfers: Transfers, *, timeout: float) -> None:
        self._transfers = transfers
        self._timeout = timeout

    async def run(
        self,
        receive: MemoryObjectReceiveStream[StoreBatch],
        send: MemoryObjectSendStream[StoreBatch],
    ) -> None:
        await drive(self, receive, send)

    async def handle(self, batch: StoreBatch, emit: Emit) -> None:
        request = batch.request
        if request.dropping:
            release(batch.objs)
            request.finish_batch()
            return
        try:
            await self._copy(batch)
        except Exception as exc:
            log.exception("store_copy_failed", req_id=request.req_id)
            release(batch.objs)
            request.fail(exc)
            request.finish_batch()
            return
        except BaseException:  # run inline: the caller was cancelled mid-copy
            release(batch.objs)
            request.stopped = True
            request.finish_batch()
            raise
        await emit(batch)

    async def _copy(self, batch: StoreBatch) -> None:
        request = batch.request
        plan = request.plan
        jobs = [
            (request.spans[index].start, request.spans[index].end, obj.tensor)
            for index, obj in zip(batch.indices, batch.objs, strict=True)
        ]
        await self._transfers.run(
            plan.gather_chunks,
            jobs,
            device=plan.device,
            direction=Direction.STORE,
            nbytes=sum(obj.nbytes for obj in batch.objs),
            timeout=self._timeout,
        )


class PutStage:
    """Hands the filled payloads to the storage manager and finishes the batch."""

    name = "store-put"

    def __init__(self, manager: StorageManager) -> None:
        self._manager = manager

    async def run(
        self,
        receive: MemoryObjectReceiveStream[StoreBatch],
        send: MemoryObjectSendStream[Any],
    ) -> None:
        await drive(self, receive, send)

    async def handle(self, batch: StoreBatch, emit: Emit) -> None:
        request = batch.request
        try:
            if not request.dropping:
                spans = [request.spans[i] for i in batch.indices]
                kept = await self._manager.put(spans, batch.objs, request.tokens, request.locations)
                # Hold what the CPU tier now has under these keys (another request may
                # have put the same chunk first) until this request ends; chunks written
                # to slow tiers only are held by their writers.
                cached = self._manager.hold([span.key for span in spans[:kept]])
                for i, obj in zip(batch.indices[:kept], cached, strict=True):
                    request.stored[i] = True
                    if obj is not None:
                        request.held.append(obj)
        finally:
            release(batch.objs)
            request.finish_batch()


def build_store_stages(
    manager: StorageManager,
    pool: MemoryPool,
    layout: KVLayout,
    transfers: Transfers,
    *,
    batch_chunks: int,
    allocation_timeout: float,
    copy_timeout: float,
) -> list[Any]:
    """The store stages in order, ready for :class:`~.stage.Pipeline`."""
    return [
        HashStage(manager, batch_chunks=batch_chunks),
        AllocateStage(pool, layout, timeout=allocation_timeout),
        CopyStage(transfers, timeout=copy_timeout),
        PutStage(manager),
    ]
