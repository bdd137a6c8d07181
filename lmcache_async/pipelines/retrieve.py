"""The retrieve pipeline: lookup → prefetch → H2D copy.

Lookup finds how many chunks, from the request's first wanted chunk on, the cache holds;
prefetch takes references on their payloads (a payload referenced by a request cannot be
evicted under it); the copy stage scatters them into the serving engine's KV memory, batch
by batch, in order. A request resolves to a bool mask of the tokens whose KV was written.
If a batch cannot be served (its chunks vanished, a copy failed), the rest of the request is
dropped, so the mask is always a run from the first wanted token: the serving engine
recomputes the remainder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..backends.manager import StorageManager
from ..cuda import Direction, Transfers
from ..keys import ChunkSpan
from ..layouts import KVLayout
from ..memory import MemoryObj
from .common import Request, batched, compute_spans, release
from .stage import Completion, Emit, drive

__all__ = ["RetrieveBatch", "RetrieveRequest", "build_retrieve_stages"]

log = structlog.get_logger(__name__)


@dataclass(eq=False, slots=True)
class RetrieveRequest(Request):
    """A retrieve in flight; ``mask`` (bool, CPU) grows as batches land."""

    mask: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    copy_failed: bool = False
    completion: Completion[torch.Tensor] = field(default_factory=Completion)
    loaded_tokens: int = 0

    def finish_batch(self) -> None:
        self.batches_done += 1
        if self.batches_done == self.batches_total:
            self.completion.set_result(self.mask)

    def finish_now(self) -> None:
        """Resolve with what has landed so far (used when the request is abandoned)."""
        self.completion.set_result(self.mask)


@dataclass(eq=False, slots=True)
class RetrieveBatch:
    request: RetrieveRequest
    spans: list[ChunkSpan]
    objs: list[MemoryObj] = field(default_factory=list)


class LookupStage:
    """Hashes the request and counts the chunks the cache holds from its first one on."""

    name = "retrieve-lookup"

    def __init__(self, manager: StorageManager, *, batch_chunks: int) -> None:
        self._manager = manager
        self._batch_chunks = batch_chunks

    async def run(
        self,
        receive: MemoryObjectReceiveStream[RetrieveRequest],
        send: MemoryObjectSendStream[RetrieveBatch],
    ) -> None:
        await drive(self, receive, send)

    async def handle(self, request: RetrieveRequest, emit: Emit) -> None:
        if request.skip:
            request.finish_now()
            return
        try:
            await compute_spans(request)
        except Exception as exc:
            request.stopped = True
            request.completion.set_error(exc)
            return
        spans = request.spans
        hits = await self._manager.lookup_prefix([span.key for span in spans], request.locations)
        groups = batched(0, hits, self._batch_chunks)
        request.batches_total = len(groups)
        if not groups:
            request.finish_now()
            return
        for group in groups:
            await emit(RetrieveBatch(request, spans[group.start : group.stop]))


class PrefetchStage:
    """Takes a reference on each payload of a batch so it stays put until copied; chunks
    held only by a slow tier are read into host memory here."""

    name = "retrieve-prefetch"

    def __init__(self, manager: StorageManager) -> None:
        self._manager = manager

    async def run(
        self,
        receive: MemoryObjectReceiveStream[RetrieveBatch],
        send: MemoryObjectSendStream[RetrieveBatch],
    ) -> None:
        await drive(self, receive, send)

    async def handle(self, batch: RetrieveBatch, emit: Emit) -> None:
        request = batch.request
        if request.skip:
            request.finish_batch()
            return
        batch.objs = await self._manager.fetch_prefix(
            [span.key for span in batch.spans], request.locations, request.lookup_id
        )
        if len(batch.objs) < len(batch.spans):
            # Evicted between lookup and now: serve the run we still have.
            request.stopped = True
            del batch.spans[len(batch.objs) :]
        if not batch.objs:
            request.finish_batch()
            return
        await emit(batch)


class CopyStage:
    """Scatters payloads into the serving engine's KV memory (H2D) and marks the mask."""

    name = "retrieve-copy"

    def __init__(self, transfers: Transfers, *, timeout: float) -> None:
        self._transfers = transfers
        self._timeout = timeout

    async def run(
        self,
        receive: MemoryObjectReceiveStream[RetrieveBatch],
        send: MemoryObjectSendStream[Any],
    ) -> None:
        await drive(self, receive, send)

    async def handle(self, batch: RetrieveBatch, emit: Emit) -> None:
        request = batch.request
        try:
            if request.cancelled or request.copy_failed:
                return
            await self._copy(batch)
            # A batch's spans are consecutive: mark them in one step. Tokens with a
            # negative slot were not written.
            start, end = batch.spans[0].start, batch.spans[-1].end
            if request.plan.first_skipped(start) is None:
                request.mask[start:end] = True
            else:
                request.mask[start:end] = request.slots_cpu[start:end] >= 0
            request.loaded_tokens += end - start
        except Exception:
            log.exception("retrieve_copy_failed", req_id=request.req_id)
            request.copy_failed = True
        finally:
            release(batch.objs)
            request.finish_batch()

    async def _copy(self, batch: RetrieveBatch) -> None:
        plan = batch.request.plan
        jobs = [
            (span.start, span.end, obj.tensor)
            for span, obj in zip(batch.spans, batch.objs, strict=True)
        ]
        await self._transfers.run(
            plan.scatter_chunks,
            jobs,
            device=plan.device,
            direction=Direction.LOAD,
            nbytes=sum(obj.nbytes for obj in batch.objs),
            timeout=self._timeout,
        )


def build_retrieve_stages(
    manager: StorageManager,
    layout: KVLayout,
    transfers: Transfers,
    *,
    batch_chunks: int,
    copy_timeout: float,
) -> list[Any]:
    """The retrieve stages in order, ready for :class:`~.stage.Pipeline`."""
    return [
        LookupStage(manager, batch_chunks=batch_chunks),
        PrefetchStage(manager),
        CopyStage(transfers, timeout=copy_timeout),
    ]
