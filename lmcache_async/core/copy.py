"""The one copy path between a serving engine's KV memory and chunk payloads.

The embedded pipelines' copy stages and the sidecar client both move a request's chunks
with these calls: :func:`gather` (D2H, a store), :func:`scatter` (H2D, a load) and
:func:`mark_loaded` (the mask of the tokens a load wrote). A copy takes the request's
:class:`~lmcache_async.transfer.plan.TransferPlan`, built once per request.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from lmcache_async.transfer.cuda import CallerStream, Direction, Transfers
from lmcache_async.transfer.plan import TransferPlan
from lmcache_async.transfer.staged import StagedPlan

__all__ = ["Job", "gather", "mark_loaded", "scatter"]

Job = tuple[int, int, torch.Tensor]
"""``(start, end, payload)``: the tokens ``[start, end)`` of the request and the chunk
payload (the layout's ``payload_shape(end - start)``) they go to or come from."""


def _nbytes(jobs: Sequence[Job]) -> int:
    return sum(payload.numel() * payload.element_size() for _, _, payload in jobs)


async def gather(
    transfers: Transfers,
    plan: TransferPlan,
    jobs: list[Job],
    *,
    timeout: float,
    caller: CallerStream | None = None,
) -> None:
    """Copy each job's tokens out of the engine's KV memory into its payload; returns
    when the copies are complete (a CPU copy, once started, is not interrupted). On CUDA
    the copies read the KV as it is at ``caller``'s point on its stream (None: the
    current stream, now), through the direction's staging buffer: a kernel per layer and
    part for the whole batch, one host copy per run of adjacent payloads."""
    staging = transfers.staging(plan.device, Direction.STORE)
    work = plan.gather_chunks
    if staging is not None:
        work = functools.partial(StagedPlan.from_plan(plan).gather_chunks, staging=staging)
    await transfers.run(
        work,
        jobs,
        device=plan.device,
        direction=Direction.STORE,
        nbytes=_nbytes(jobs),
        timeout=timeout,
        caller=caller,
        split=not plan.threads_inside,
    )


async def scatter(
    transfers: Transfers,
    plan: TransferPlan,
    jobs: list[Job],
    *,
    timeout: float,
    caller: CallerStream | None = None,
) -> None:
    """Copy each job's payload into the engine's KV memory (tokens with a negative slot
    are not written); returns when the copies are complete. On CUDA they come after
    ``caller``'s point on its stream (None: the current stream, now), and what the caller
    queues on that stream next comes after them; through a staging buffer as
    :func:`gather`."""
    staging = transfers.staging(plan.device, Direction.LOAD)
    work = plan.scatter_chunks
    if staging is not None:
        work = functools.partial(StagedPlan.from_plan(plan).scatter_chunks, staging=staging)
    await transfers.run(
        work,
        jobs,
        device=plan.device,
        direction=Direction.LOAD,
        nbytes=_nbytes(jobs),
        timeout=timeout,
        caller=caller,
        split=not plan.threads_inside,
    )


def mark_loaded(
    mask: torch.Tensor, plan: TransferPlan, slots_cpu: torch.Tensor, start: int, end: int
) -> int:
    """Mark in ``mask`` (bool, CPU) the tokens of ``[start, end)`` a scatter wrote: all
    of them, but those with a negative slot. Returns ``end - start``, the tokens loaded."""
    if plan.first_skipped(start) is None:
        mask[start:end] = True
    else:
        mask[start:end] = slots_cpu[start:end] >= 0
    return end - start
