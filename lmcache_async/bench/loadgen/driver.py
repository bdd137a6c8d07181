"""The arrivals of a load run: a closed loop or a rate, for ``duration`` seconds."""

from __future__ import annotations

import random
import time
from typing import Final, Protocol, TextIO

import anyio

from lmcache_async.bench import Progress
from lmcache_async.bench.loadgen.options import LoadOptions
from lmcache_async.bench.loadgen.tally import Tally
from lmcache_async.bench.workloads import Prompt, Workload
from lmcache_async.logging import get_logger

__all__ = ["GRACE_SECONDS", "Requester", "drive", "max_in_flight", "timed_run"]

log = get_logger(__name__)


GRACE_SECONDS: Final = 120.0
"""How long in-flight requests may run past ``duration`` before the run counts as hung."""


class Requester(Protocol):
    """What :func:`drive` needs of a runner."""

    start: float
    stopping: bool
    """Set when no more requests are to start (the run's ``on_request`` said so)."""

    async def request(self, slot: int, prompt: Prompt, arrived: float) -> None: ...


async def drive(
    options: LoadOptions,
    workload: Workload,
    runner: Requester,
    in_flight: int,
    deadline: float,
) -> None:
    """Start requests until ``deadline`` (at most ``options.requests`` of them, when set,
    and none once the runner is ``stopping``), then wait for those in flight."""
    sessions = workload.sessions if workload.sessions is not None else in_flight
    send_sessions, free_sessions = anyio.create_memory_object_stream[int](sessions)
    send_slots, free_slots = anyio.create_memory_object_stream[int](in_flight)
    for session in range(sessions):
        send_sessions.send_nowait(session)
    for slot in range(in_flight):
        send_slots.send_nowait(slot)

    async def one(slot: int, session: int, prompt: Prompt, arrived: float) -> None:
        try:
            await runner.request(slot, prompt, arrived)
        finally:
            send_sessions.send_nowait(session)
            send_slots.send_nowait(slot)

    clock = time.perf_counter
    limit = options.requests
    started = 0

    def more() -> bool:
        """Whether another request may start: before the deadline, within the limit."""
        return clock() < deadline and (not limit or started < limit) and not runner.stopping

    with send_sessions, free_sessions, send_slots, free_slots:
        async with anyio.create_task_group() as tg:
            if options.rate == 0:
                # Closed loop: each worker keeps one slot busy, taking the next free session.
                async def worker(slot: int) -> None:
                    nonlocal started
                    while more():
                        session = await free_sessions.receive()
                        try:
                            if more():
                                started += 1
                                prompt = workload.next_prompt(session)
                                await runner.request(slot, prompt, clock())
                        finally:
                            send_sessions.send_nowait(session)

                for slot in range(in_flight):
                    tg.start_soon(worker, slot)
                return
            gaps = random.Random(options.seed)
            arrival = clock()
            while True:
                gap = 1.0 / options.rate
                if options.arrival == "poisson":
                    gap = gaps.expovariate(options.rate)
                arrival += gap
                if arrival >= deadline or not more():
                    break
                await anyio.sleep(max(0.0, arrival - clock()))
                slot = await free_slots.receive()
                session = await free_sessions.receive()
                started += 1
                tg.start_soon(one, slot, session, workload.next_prompt(session), arrival)


async def timed_run(
    options: LoadOptions,
    workload: Workload,
    runner: Requester,
    in_flight: int,
    *,
    tally: Tally,
    stream: TextIO,
) -> float:
    """Drive the workload for ``options.duration`` with progress; returns the wall time."""
    clock = time.perf_counter
    start = runner.start = clock()
    deadline = start + options.duration
    progress = Progress(options.duration, stream) if options.progress else None
    try:
        with anyio.fail_after(options.duration + GRACE_SECONDS):
            async with anyio.create_task_group() as outer:
                if progress is not None:

                    async def show() -> None:
                        while True:
                            progress.update(clock() - start, tally.progress_text())
                            await anyio.sleep(1.0)

                    outer.start_soon(show)
                await drive(options, workload, runner, in_flight, deadline)
                outer.cancel_scope.cancel()
    except TimeoutError:
        tally.errors["run:timeout"] += 1
        log.error("bench_run_timed_out", seconds=options.duration + GRACE_SECONDS)
    finally:
        if progress is not None:
            progress.close()
    return clock() - start


def max_in_flight(options: LoadOptions, workload: Workload) -> int:
    """How many requests run at once: ``concurrency``, but no more than the workload has
    sessions (a conversation has one request in flight at a time)."""
    sessions = workload.sessions if workload.sessions is not None else options.concurrency
    return min(options.concurrency, sessions)
