"""The copies of a layerwise request, one per layer (:mod:`lmcache_async.pipelines.layerwise`).

On the CPU a layer's copy runs when its step asks for it. On CUDA it is queued on the
direction's stream and not waited for: a store's layer behind a point marked on the
caller's stream (after the caller's compute of it), a load's behind the request's point,
the caller's stream then made to wait for it on the device (``wait_event``) by the step
that hands the layer over. Each copy's completion is awaited by a task on the event loop
(:class:`~lmcache_async.transfer.cuda.Queued`), which hands the layer's host memory back; the
request's last step waits for them all.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import TypeVar

import torch

from lmcache_async.transfer.cuda import (
    CallerStream,
    Direction,
    Queued,
    Transfers,
    caller_stream,
    wait_out,
)

__all__ = ["LayerCopies"]

J = TypeVar("J")


class LayerCopies:
    """The layer copies of one layerwise request: run at once on the CPU, queued ahead on
    CUDA.

    On the CPU :meth:`start` runs the copy and the rest has nothing to do. On CUDA
    :meth:`start` queues the copy on the direction's stream and returns without waiting
    for it; a task awaits its completion event on the loop (then ``on_done`` runs: a load
    hands its layer's payloads back there). :meth:`hand_over` makes the caller's stream
    wait for a load's layer on the device; :meth:`finish` awaits every copy. ``caller`` is
    the request's point on the caller's stream (None on the CPU); a store's step marks a
    new one.
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
        if caller is None and device.type == "cuda":
            caller = caller_stream(device)
        self._caller = caller
        self._queued: dict[int, Queued] = {}  # a load's layers not handed over yet
        self._tasks: dict[int, asyncio.Task[None]] = {}

    @property
    def ahead(self) -> bool:
        """Whether a copy may run ahead of the step that needs it (CUDA streams)."""
        return self._device.type == "cuda"

    async def start(
        self,
        layer: int,
        work: Callable[[list[J]], None],
        jobs: list[J],
        nbytes: int,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """Run (CPU) or queue (CUDA) layer ``layer``'s copy; ``on_done`` runs on the loop
        once it has completed without a failure."""
        if not self.ahead:
            await self._transfers.run(
                work,
                jobs,
                device=self._device,
                direction=self._direction,
                nbytes=nbytes,
                timeout=self._timeout,
            )
            if on_done is not None:
                on_done()
            return
        caller = self._caller
        assert caller is not None  # made for CUDA caches in __init__
        # A store's layer: now, after the caller's compute of it. A load's: the request's
        # point, its stream ordered after the layer by hand_over() at the next step (a
        # wait queued now would hold the caller's compute of the layer before).
        store = self._direction is Direction.STORE
        queued = await self._transfers.queue(
            work,
            jobs,
            device=self._device,
            direction=self._direction,
            timeout=self._timeout,
            caller=caller.mark() if store else caller.handed_over(),
        )
        if not store:
            self._queued[layer] = queued
        task = asyncio.ensure_future(queued.wait())
        if on_done is not None:
            task.add_done_callback(functools.partial(_after, on_done))
        self._tasks[layer] = task

    def hand_over(self, layer: int) -> None:
        """Make the caller's stream wait, on the device, for a load's layer ``layer``
        (queued by :meth:`start`): what the caller queues next reads that layer. Nothing
        when it was not queued (the CPU, a miss, a failure)."""
        queued = self._queued.pop(layer, None)
        if queued is not None and self._caller is not None:
            self._caller.consume(queued.event)

    async def finish(self) -> None:
        """Wait for every copy queued; re-raises the first failure.

        Not interrupted by cancellation (the memory the copies touch is released next),
        which is raised once they are done.
        """
        tasks = list(self._tasks.values())
        await wait_out(tasks)
        self._tasks.clear()
        for task in tasks:
            if not task.cancelled() and (exc := task.exception()) is not None:
                raise exc

    async def drain(self) -> None:
        """Wait for every copy still queued, ignoring failures (used when closing).

        Not interrupted by cancellation: the memory the copies touch is released next.
        The cancellation is re-raised once they are done.
        """
        self._queued.clear()
        tasks = list(self._tasks.values())
        self._tasks.clear()
        try:
            await wait_out(tasks)
        finally:
            for task in tasks:
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: a failure while closing is not news


def _after(on_done: Callable[[], None], task: asyncio.Task[None]) -> None:
    """``on_done()`` once ``task`` (a copy's completion) has ended without a failure."""
    if not task.cancelled() and task.exception() is None:
        on_done()
