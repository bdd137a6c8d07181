"""Driving a target with a trace's requests, in arrival order.

The file is read as the replay goes (a batch of lines at a time, in a worker thread), and a
request's prompt is built just before it is sent (:class:`~.tokens.BlockTokens`): at most
``concurrency`` requests, and as many waiting in a bounded stream, hold tokens at any time.

Two paces:

- **closed loop** (``speed`` None): ``concurrency`` workers each take the next request as
  soon as their last one ended;
- **timestamps** (``speed`` X): request ``i`` arrives ``(timestamp_i - timestamp_0) / X``
  after the start and waits for one of ``concurrency`` slots when all are busy; its times
  count from its arrival, so a replay too fast for the target shows as queueing.

A request is a :class:`Step`: against a cache, the load generator's lookup, retrieve of the
hit, store of the whole prompt (:class:`~lmcache_async.bench.loadgen.runner.CacheRunner`);
against vLLM, one generation of ``min(output_length, max_tokens)`` tokens (at least one). A
step that fails is counted by its runner; one that takes over ``request_timeout`` is
cancelled and counted here (``request:timeout``), and the replay goes on.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Final

import anyio
from anyio.abc import ObjectReceiveStream, TaskGroup

from lmcache_async.bench.loadgen.runner import CacheRunner, VllmRunner
from lmcache_async.bench.loadgen.tally import Tally
from lmcache_async.bench.scale.fill import FillProgress
from lmcache_async.bench.trace.parse import TraceRequest
from lmcache_async.bench.trace.tokens import BlockTokens
from lmcache_async.bench.workloads import Prompt
from lmcache_async.logging import get_logger

__all__ = ["READ_BATCH", "Step", "beside_step", "cache_step", "replay", "vllm_step"]

log = get_logger(__name__)

READ_BATCH: Final = 64
"""Requests read from the file per worker-thread hop."""

Step = Callable[[int, TraceRequest, Prompt, float], Awaitable[None]]
"""One request in KV slot ``slot``: ``(slot, request, prompt, arrived)``; never raises."""


def cache_step(runner: CacheRunner) -> Step:
    """A request against a cache: lookup, retrieve of the hit, store of the prompt."""

    async def step(slot: int, request: TraceRequest, prompt: Prompt, arrived: float) -> None:
        await runner.request(slot, prompt, arrived)

    return step


def beside_step(runner: CacheRunner, beside: CacheRunner) -> Step:
    """A request against two caches one after the other, which of them first alternating
    from request to request: both see the machine as it is at that moment (a noisy
    machine moves every figure between runs), and neither always finds the other's work
    just done. The second's request time counts from when it starts."""
    turns = itertools.count()

    async def step(slot: int, request: TraceRequest, prompt: Prompt, arrived: float) -> None:
        first, second = (runner, beside) if next(turns) % 2 == 0 else (beside, runner)
        await first.request(slot, prompt, arrived)
        await second.request(slot, prompt, time.perf_counter())

    return step


def vllm_step(runner: VllmRunner, max_tokens: int) -> Step:
    """A request against vLLM: ``output_length`` tokens generated, capped by
    ``max_tokens`` (and at least one)."""

    async def step(slot: int, request: TraceRequest, prompt: Prompt, arrived: float) -> None:
        tokens = max(1, min(request.output_length, max_tokens))
        await runner.request(slot, prompt, arrived, max_tokens=tokens)

    return step


async def _batches(requests: Iterator[TraceRequest]) -> list[TraceRequest]:
    """The next requests of the file, read in a worker thread (empty at its end)."""
    return await anyio.to_thread.run_sync(list, itertools.islice(requests, READ_BATCH))


async def replay(
    requests: Iterator[TraceRequest],
    step: Step,
    *,
    tokens: BlockTokens,
    tally: Tally,
    concurrency: int,
    speed: float | None,
    request_timeout: float,
    progress: FillProgress | None = None,
) -> float:
    """Send every request of ``requests`` through ``step`` at the pace chosen (see the
    module docstring); returns the wall time in seconds.

    Raises:
        InvalidInputError: a line of the trace breaks the format (the requests before it
            ran).
    """
    clock = time.perf_counter

    async def one(slot: int, request: TraceRequest, prompt: Prompt, arrived: float) -> None:
        try:
            with anyio.fail_after(request_timeout):
                await step(slot, request, prompt, arrived)
        except TimeoutError:
            tally.errors["request:timeout"] += 1
            log.warning("bench_trace_request_timed_out", line=request.line)
        if progress is not None:
            progress.advance(1)

    start = clock()
    if speed is None:
        await _closed_loop(requests, one, tokens, concurrency)
    else:
        await _timed(requests, one, tokens, concurrency, speed)
    return clock() - start


async def _closed_loop(
    requests: Iterator[TraceRequest], one: Step, tokens: BlockTokens, concurrency: int
) -> None:
    """``concurrency`` workers, each sending the next request when its last one ended."""
    send, receive = anyio.create_memory_object_stream[tuple[TraceRequest, Prompt]](concurrency)

    async def read() -> None:
        async with send:
            while batch := await _batches(requests):
                for request in batch:
                    await send.send((request, tokens.prompt(request)))

    async def work(slot: int, queue: ObjectReceiveStream[tuple[TraceRequest, Prompt]]) -> None:
        async with queue:
            async for request, prompt in queue:
                await one(slot, request, prompt, time.perf_counter())

    async with anyio.create_task_group() as tg, receive:
        for slot in range(concurrency):
            tg.start_soon(work, slot, receive.clone())
        await read()


async def _timed(
    requests: Iterator[TraceRequest],
    one: Step,
    tokens: BlockTokens,
    concurrency: int,
    speed: float,
) -> None:
    """Each request at its timestamp over ``speed``, in one of ``concurrency`` slots."""
    send_slots, free_slots = anyio.create_memory_object_stream[int](concurrency)
    for slot in range(concurrency):
        send_slots.send_nowait(slot)

    async def run(tg: TaskGroup) -> None:
        first: float | None = None
        start = time.perf_counter()
        while batch := await _batches(requests):
            for request in batch:
                if first is None:
                    first = request.timestamp
                arrival = start + (request.timestamp - first) / 1e3 / speed
                await anyio.sleep(max(0.0, arrival - time.perf_counter()))
                slot = await free_slots.receive()
                tg.start_soon(in_slot, slot, request, tokens.prompt(request), arrival)

    async def in_slot(slot: int, request: TraceRequest, prompt: Prompt, arrived: float) -> None:
        try:
            await one(slot, request, prompt, arrived)
        finally:
            send_slots.send_nowait(slot)

    with send_slots, free_slots:
        async with anyio.create_task_group() as tg:
            await run(tg)
