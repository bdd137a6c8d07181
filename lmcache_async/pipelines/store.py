"""The store pipeline: hash → reserve → D2H copy → commit.

The stages run the phases of the request core's store (:class:`~lmcache_async.core.StoreCore`)
and copy between them; every rule (what is skipped, the partial-store rule, counters) is the
core's. Each request is cut into batches of chunks; a batch moves through the stages on its
own, so the copy of batch *i+1* overlaps the commit of batch *i* and many requests share the
stages. A request resolves to the number of tokens, from its first stored chunk on, whose
chunks are cached when it finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import MemoryObj
from lmcache_async.transfer.cuda import Transfers

from ..core import StoreCore, StoreTxn
from ..core.copy import gather
from ..core.store import release
from .common import Request, batched, compute_spans
from .stage import Completion, Emit, drive

__all__ = ["StoreBatch", "StoreRequest", "build_store_stages"]

log = get_logger(__name__)


@dataclass(eq=False, slots=True)
class StoreRequest(Request):
    """A store in flight. ``limit``: no chunk ending after this token index is stored.

    ``txn`` is the store's transaction with the request core (what it writes, what it
    holds); the request resolves only when every batch is accounted for, so nothing of it
    is still running when the caller gets the answer.
    """

    limit: int = 0
    completion: Completion[int] = field(default_factory=Completion)
    txn: StoreTxn | None = None
    error: BaseException | None = None

    @property
    def dropping(self) -> bool:
        """True when no further batch of this request may be copied or put."""
        return self.cancelled or self.error is not None

    def stored_tokens(self) -> int:
        """Tokens covered by the leading run of chunks cached so far."""
        return self.txn.stored_tokens() if self.txn is not None else 0

    def finish_batch(self, core: StoreCore) -> None:
        self.batches_done += 1
        if self.batches_done == self.batches_total:
            self.finish(core)

    def finish(self, core: StoreCore) -> None:
        """End the store with the core and resolve the request."""
        stored = core.finish(self.txn) if self.txn is not None else 0
        if self.error is not None:
            self.completion.set_error(self.error)
        else:
            self.completion.set_result(stored)

    def fail(self, error: BaseException) -> None:
        """Record the first failure; the remaining batches are dropped."""
        self.stopped = True
        if self.error is None:
            self.error = error


@dataclass(eq=False, slots=True)
class StoreBatch:
    request: StoreRequest
    txn: StoreTxn
    indices: list[int]  # positions in txn.spans
    objs: list[MemoryObj] = field(default_factory=list)


class HashStage:
    """Cuts a request into chunk keys and begins its store with the core (chunks already
    cached are skipped), then emits the chunks to write in batches."""

    name = "store-hash"

    def __init__(self, core: StoreCore, *, batch_chunks: int) -> None:
        self._core = core
        self._batch_chunks = batch_chunks

    async def run(
        self,
        receive: MemoryObjectReceiveStream[StoreRequest],
        send: MemoryObjectSendStream[StoreBatch],
    ) -> None:
        await drive(self, receive, send)

    async def handle(self, request: StoreRequest, emit: Emit) -> None:
        core = self._core
        if request.skip:
            request.finish(core)
            return
        try:
            await compute_spans(request)
        except Exception as exc:  # invalid tokens found off the loop
            request.fail(exc)
            request.finish(core)
            return
        txn = core.begin(
            request.req_id,
            request.spans,
            request.tokens,
            limit=request.limit,
            locations=request.locations,
        )
        request.txn = txn
        todo = txn.todo
        groups = batched(0, len(todo), self._batch_chunks)
        request.batches_total = len(groups)
        if not groups:
            request.finish(core)
            return
        for group in groups:
            await emit(StoreBatch(request, txn, [todo[i] for i in group]))


class AllocateStage:
    """Reserves host memory for each chunk of a batch with the core, waiting (bounded)
    for space; memory that cannot be had in time makes the store partial."""

    name = "store-allocate"

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    async def run(
        self,
        receive: MemoryObjectReceiveStream[StoreBatch],
        send: MemoryObjectSendStream[StoreBatch],
    ) -> None:
        await drive(self, receive, send)

    async def handle(self, batch: StoreBatch, emit: Emit) -> None:
        request, core = batch.request, self._core
        if request.skip:
            request.finish_batch(core)
            return
        try:
            batch.objs = await core.reserve(batch.txn, batch.indices, request)
        except Exception as exc:
            request.fail(exc)
            request.finish_batch(core)
            return
        except BaseException:  # run inline: the caller was cancelled while it waited
            request.stopped = True
            request.finish_batch(core)
            raise
        if len(batch.objs) < len(batch.indices):
            request.stopped = True  # out of memory in time, or cancelled: no later batch
            del batch.indices[len(batch.objs) :]
        if not batch.objs:
            request.finish_batch(core)
            return
        await emit(batch)


class CopyStage:
    """Gathers each chunk's KV out of the engine's memory into its host payload (D2H)."""

    name = "store-copy"

    def __init__(self, core: StoreCore, transfers: Transfers, *, timeout: float) -> None:
        self._core = core
        self._transfers = transfers
        self._timeout = timeout

    async def run(
        self,
        receive: MemoryObjectReceiveStream[StoreBatch],
        send: MemoryObjectSendStream[StoreBatch],
    ) -> None:
        await drive(self, receive, send)

    async def handle(self, batch: StoreBatch, emit: Emit) -> None:
        request, core = batch.request, self._core
        if request.dropping:
            release(batch.objs)
            request.finish_batch(core)
            return
        spans = batch.txn.spans
        jobs = [
            (spans[index].start, spans[index].end, obj.tensor)
            for index, obj in zip(batch.indices, batch.objs, strict=True)
        ]
        try:
            await gather(
                self._transfers,
                request.plan,
                jobs,
                timeout=self._timeout,
                caller=request.caller_stream,
            )
        except Exception as exc:
            log.exception("store_copy_failed", req_id=request.req_id)
            release(batch.objs)
            request.fail(exc)
            request.finish_batch(core)
            return
        except BaseException:  # run inline: the caller was cancelled mid-copy
            release(batch.objs)
            request.stopped = True
            request.finish_batch(core)
            raise
        await emit(batch)


class CommitStage:
    """Commits the filled payloads with the core (into the tiers) and finishes the batch."""

    name = "store-commit"

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    async def run(
        self,
        receive: MemoryObjectReceiveStream[StoreBatch],
        send: MemoryObjectSendStream[Any],
    ) -> None:
        await drive(self, receive, send)

    async def handle(self, batch: StoreBatch, emit: Emit) -> None:
        request, core = batch.request, self._core
        try:
            if request.dropping:
                release(batch.objs)
            else:
                await core.commit(batch.txn, batch.indices, batch.objs)
        finally:
            request.finish_batch(core)


def build_store_stages(
    core: StoreCore,
    transfers: Transfers,
    *,
    batch_chunks: int,
    copy_timeout: float,
) -> list[Any]:
    """The store stages in order, ready for :class:`~.stage.Pipeline`."""
    return [
        HashStage(core, batch_chunks=batch_chunks),
        AllocateStage(core),
        CopyStage(core, transfers, timeout=copy_timeout),
        CommitStage(core),
    ]
