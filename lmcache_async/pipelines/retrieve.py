"""The retrieve pipeline: lookup → reserve → H2D copy (→ release).

The stages run the phases of the request core's load (:class:`~lmcache_async.core.LoadCore`)
and copy between them. Lookup cuts the chunks a load may find into batches; reserve takes
references on their payloads (a payload referenced by a request cannot be evicted under
it), reading those only a slow tier holds; the copy stage scatters them into the serving
engine's KV memory, batch by batch, in order, and releases them. A request resolves to a
bool mask of the tokens whose KV was written. If a batch cannot be served (its chunks
vanished, a copy failed), the rest of the request is dropped, so the mask is always a run
from the first wanted token: the serving engine recomputes the remainder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from lmcache_async.keys.chunks import ChunkSpan
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import AllocationBudget, MemoryObj
from lmcache_async.transfer.cuda import Transfers

from ..core import LoadCore
from ..core.copy import mark_loaded, scatter
from .common import Request, compute_spans
from .stage import Completion, Emit, drive

__all__ = ["RetrieveBatch", "RetrieveRequest", "build_retrieve_stages"]

log = get_logger(__name__)


@dataclass(eq=False, slots=True)
class RetrieveRequest(Request):
    """A retrieve in flight; ``mask`` (bool, CPU) grows as batches land."""

    mask: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    copy_failed: bool = False
    completion: Completion[torch.Tensor] = field(default_factory=Completion)
    loaded_tokens: int = 0
    # The request's waits for pool memory, over all its batches, share one allowance.
    budget: AllocationBudget = field(default_factory=AllocationBudget)

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
    """Hashes the request and cuts the chunks a load may find into batches."""

    name = "retrieve-lookup"

    def __init__(self, core: LoadCore) -> None:
        self._core = core

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
        keys = [span.key for span in spans]
        groups = self._core.batches(
            keys, self._core.findable(keys, request.locations), request.locations
        )
        request.batches_total = len(groups)
        if not groups:
            request.finish_now()
            return
        for group in groups:
            await emit(RetrieveBatch(request, spans[group.start : group.stop]))


class ReserveStage:
    """Reserves the payloads of a batch with the core (referenced, so they stay put until
    copied); chunks held only by a slow tier are read into host memory here, within the
    request's :class:`~lmcache_async.memory.pool.AllocationBudget`. The first chunk no tier
    holds (or none has memory for) ends the request's run."""

    name = "retrieve-reserve"

    def __init__(self, core: LoadCore) -> None:
        self._core = core

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
        with request.budget.scope():
            batch.objs = await self._core.reserve(
                [span.key for span in batch.spans], request.locations, request.lookup_id
            )
        if len(batch.objs) < len(batch.spans):
            # The run ends here (not held, or evicted since): serve the run we have.
            request.stopped = True
            del batch.spans[len(batch.objs) :]
        if not batch.objs:
            request.finish_batch()
            return
        await emit(batch)


class CopyStage:
    """Scatters payloads into the serving engine's KV memory (H2D), marks the mask and
    releases the payloads to the core."""

    name = "retrieve-copy"

    def __init__(self, core: LoadCore, transfers: Transfers, *, timeout: float) -> None:
        self._core = core
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
            jobs = [
                (span.start, span.end, obj.tensor)
                for span, obj in zip(batch.spans, batch.objs, strict=True)
            ]
            await scatter(
                self._transfers,
                request.plan,
                jobs,
                timeout=self._timeout,
                caller=request.caller_stream,
            )
            # A batch's spans are consecutive: marked in one step.
            request.loaded_tokens += mark_loaded(
                request.mask,
                request.plan,
                request.slots_cpu,
                batch.spans[0].start,
                batch.spans[-1].end,
            )
        except Exception:
            log.exception("retrieve_copy_failed", req_id=request.req_id)
            request.copy_failed = True
        finally:
            self._core.release(batch.objs)
            request.finish_batch()


def build_retrieve_stages(
    core: LoadCore, transfers: Transfers, *, copy_timeout: float
) -> list[Any]:
    """The retrieve stages in order, ready for :class:`~.stage.Pipeline` (the load's
    batches are the core's: :meth:`LoadCore.batches <lmcache_async.core.LoadCore.batches>`)."""
    return [
        LookupStage(core),
        ReserveStage(core),
        CopyStage(core, transfers, timeout=copy_timeout),
    ]
