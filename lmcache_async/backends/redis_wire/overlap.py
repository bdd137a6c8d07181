"""Running tasks side by side with plain errors: :func:`concurrently` (a cluster call's
nodes at once) raises the first error itself, never an exception group, once every task
has stopped: the callers map errors to the tier's at one boundary
(:meth:`~lmcache_async.backends.redis_conn.RedisConnection.guard`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

__all__ = ["concurrently"]


async def concurrently(*jobs: Callable[[], Awaitable[object]]) -> None:
    """Run ``jobs`` at once; the first to fail cancels the others, and its error is raised
    once they have stopped. One job runs in the caller's task."""
    if len(jobs) == 1:
        await jobs[0]()
        return
    errors: list[Exception] = []

    async def run(job: Callable[[], Awaitable[object]]) -> None:
        try:
            await job()
        except Exception as exc:
            errors.append(exc)
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        for job in jobs:
            tg.start_soon(run, job)
    if errors:
        raise errors[0]
