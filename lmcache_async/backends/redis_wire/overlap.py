"""Running stages side by side with plain errors: :func:`overlapped` (a two-stage pipeline,
CPU work beside network I/O) and :func:`concurrently` (tasks that end together).

Both raise the first error itself, never an exception group, once every task has
stopped: the callers map errors to the tier's at one boundary
(:meth:`~lmcache_async.backends.redis_conn.RedisConnection.guard`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

__all__ = ["concurrently", "overlapped"]

T = TypeVar("T")


async def overlapped(
    count: int,
    first: Callable[[int], Awaitable[T]],
    second: Callable[[int, T], Awaitable[bool]],
) -> None:
    """Run ``second(n, await first(n))`` for ``n`` in ``range(count)``, in order, with
    ``first(n + 1)`` running while ``second(n)`` does (network I/O beside CPU work).

    ``second`` returning True stops the run. The first error of either stage is raised
    as is (not in an exception group) once the other stage has stopped; what ``first``
    produced and ``second`` never saw is dropped, so ``first`` must not hand over
    anything that needs releasing.
    """
    if count <= 1:
        if count:
            await second(0, await first(0))
        return
    errors: list[Exception] = []
    send, receive = anyio.create_memory_object_stream[tuple[int, T]]()

    async def produce() -> None:
        async with send:
            for n in range(count):
                try:
                    item = await first(n)
                except Exception as exc:
                    errors.append(exc)
                    return
                try:
                    await send.send((n, item))
                except anyio.BrokenResourceError:
                    return  # the consumer stopped

    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
        try:
            async with receive:
                async for n, item in receive:
                    if await second(n, item):
                        break
        except Exception as exc:
            errors.insert(0, exc)
        tg.cancel_scope.cancel()
    if errors:
        raise errors[0]


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
