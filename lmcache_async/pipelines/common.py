"""Pieces shared by the store and retrieve pipelines."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import anyio
import anyio.to_thread
import numpy as np
import torch

from lmcache_async.keys.chunks import ChunkSpan
from lmcache_async.transfer.cuda import CallerStream

from ..layouts import TransferPlan

__all__ = ["Keyer", "Request", "batched", "compute_spans"]

# Produces a request's chunk spans and, when keys come from tokens, the tokens as int32.
Keyer = Callable[[], tuple[list[ChunkSpan], np.ndarray | None]]


@dataclass(eq=False, slots=True)
class Request:
    """What the stages of either pipeline need to know about one request.

    ``plan`` moves tokens between the serving engine's memory and payloads; ``slots_cpu`` is
    the request's slot mapping as int64 on the host; ``caller_stream`` (CUDA caches only)
    is the point on the caller's stream the copies are ordered against. Counters track
    the batches still in the pipeline so the stage that finishes the last one can resolve
    the request.
    """

    req_id: str
    keyer: Keyer
    num_tokens: int
    hash_inline: bool
    plan: TransferPlan
    slots_cpu: torch.Tensor
    cancelled: bool = False
    stopped: bool = False  # no further batch may be copied (memory ran out, a hit vanished)
    batches_total: int = -1  # unknown until the first stage has cut the request
    batches_done: int = 0
    spans: list[ChunkSpan] = field(default_factory=list)
    tokens: np.ndarray | None = None
    # Set while a stage waits on behalf of this request, so cancel() can end the wait.
    waiting: anyio.CancelScope | None = None
    # Tiers this request writes to or reads from (None: the engine's configured ones).
    locations: tuple[str, ...] | None = None
    # A retrieve is served first from what was prefetched under this lookup id.
    lookup_id: Hashable | None = None
    # Where the caller produces or consumes the KV (None: caches on the CPU).
    caller_stream: CallerStream | None = None

    def cancel(self) -> None:
        """Abandon the request: stages drop what remains of it and return its memory."""
        self.cancelled = True
        if self.waiting is not None:
            self.waiting.cancel()

    @property
    def device(self) -> torch.device:
        return self.plan.device

    @property
    def skip(self) -> bool:
        """True when the remaining batches of this request must be dropped."""
        return self.cancelled or self.stopped


async def compute_spans(request: Request) -> None:
    """Hash the request's tokens, in a worker thread when the prompt is long."""
    if request.hash_inline:
        request.spans, request.tokens = request.keyer()
    else:
        request.spans, request.tokens = await anyio.to_thread.run_sync(request.keyer)


def batched(start: int, stop: int, size: int) -> list[range]:
    """Index ranges of at most ``size`` covering ``[start, stop)``."""
    return [range(i, min(i + size, stop)) for i in range(start, stop, size)]
