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
from lmcache_async.transfer.pipelined import gather_pipelined, scatter_pipelined
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
    current stream, now), staged and double-buffered
    (:func:`~lmcache_async.transfer.pipelined.gather_pipelined`): a kernel per layer and
    part for each of a few passes, one host copy per run of adjacent payloads, a pass's
    gather overlapping the previous pass's copy. Where ``transfers`` offers no staging
    buffer, the plan's own copies run (on CUDA on the direction's stream); where it offers
    one for CPU caches, the batch is staged on the spot (:class:`StagedPlan`)."""
    await _copy(transfers, plan, jobs, Direction.STORE, timeout=timeout, caller=caller)


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
    queues on that stream next comes after them; staged and double-buffered as
    :func:`gather` (a pass's host copy overlapping the previous pass's scatter), or as
    :func:`gather` says without staging buffers."""
    await _copy(transfers, plan, jobs, Direction.LOAD, timeout=timeout, caller=caller)


async def _copy(
    transfers: Transfers,
    plan: TransferPlan,
    jobs: list[Job],
    direction: Direction,
    *,
    timeout: float,
    caller: CallerStream | None,
) -> None:
    """A store's gather or a load's scatter, staged and double-buffered on CUDA, the
    plan's own copies (staged on the spot where ``transfers`` offers a CPU staging
    buffer) elsewhere."""
    store = direction is Direction.STORE
    staging = transfers.staging(plan.device, direction)
    if plan.device.type == "cuda" and staging is not None:
        pipelined = gather_pipelined if store else scatter_pipelined
        await transfers.run_staged(
            functools.partial(pipelined, StagedPlan.from_plan(plan)),
            jobs,
            device=plan.device,
            direction=direction,
            timeout=timeout,
            caller=caller,
        )
        return
    work = plan.gather_chunks if store else plan.scatter_chunks
    if staging is not None:  # a Transfers that stages the CPU's copies too
        staged = StagedPlan.from_plan(plan)
        method = staged.gather_chunks if store else staged.scatter_chunks
        work = functools.partial(method, staging=staging)
    await transfers.run(
        work,
        jobs,
        device=plan.device,
        direction=direction,
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
