"""Where copies run: inline, in a worker thread, or on a dedicated CUDA stream.

On CUDA a copy is queued on its own stream (one for loads, one for stores), an event is
recorded behind it, and the caller awaits that event through :class:`EventBridge`: one waiter
thread per stream blocks in ``Event.synchronize()`` and resolves an asyncio future with
``call_soon_threadsafe``, so the event loop never blocks on the GPU and no thread is held per
copy. On the CPU the bridge is not used: small copies run inline on the loop (a thread hop
costs more than they do) and large ones on a small pool of copy threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import functools
import queue
import threading
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import anyio
import structlog
import torch

from .errors import EngineClosedError

__all__ = ["Direction", "EventBridge", "Transfers", "wait_out"]

log = structlog.get_logger(__name__)

J = TypeVar("J")


class Direction(enum.StrEnum):
    STORE = "store"  # engine memory -> host payload (D2H)
    LOAD = "load"  # host payload -> engine memory (H2D)


_Job = tuple[Any, asyncio.AbstractEventLoop, "asyncio.Future[None]"]


class EventBridge:
    """Turns completion of CUDA events into awaitables on the running event loop.

    Events of one stream complete in the order they were recorded, so a single waiter
    thread serves a stream: it synchronizes on the oldest event and wakes its awaiter.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=f"cuda-bridge-{name}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            event, loop, future = job
            try:
                event.synchronize()
            except Exception as exc:  # a device error must reach the awaiting request
                loop.call_soon_threadsafe(_fail, future, exc)
            else:
                loop.call_soon_threadsafe(_finish, future)

    async def wait(self, event: Any, *, timeout: float) -> None:
        """Wait until ``event`` (a ``torch.cuda.Event``) has completed.

        Not interrupted by a cancellation, which is raised once the event has completed.
        Raises TimeoutError when it took longer than ``timeout`` seconds, but only once it
        has completed (the memory of the copy is then free to reuse); EngineClosedError
        after close().
        """
        if self._closed:
            raise EngineClosedError("the CUDA event bridge is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._jobs.put((event, loop, future))
        if await wait_out((future,), timeout=timeout):
            # The copy was still queued on the device past the timeout; its host memory
            # could not be handed back before it completed. Fail the request now.
            raise TimeoutError(f"a CUDA copy took longer than {timeout} s")
        future.result()  # a device error

    def close(self) -> None:
        """Stop the waiter thread once the events already queued have completed."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join()


async def wait_out(
    futures: Collection[asyncio.Future[Any]], *, timeout: float | None = None
) -> bool:
    """Wait until every one of ``futures`` is done, whatever happens to this task
    meanwhile; returns whether that took longer than ``timeout`` seconds (logged then).

    The futures stand for copies writing memory that the caller hands back once this
    returns. AnyIO cancellation is held off by a shield; asyncio's own (``task.cancel()``,
    ``asyncio.timeout``, ``wait_for``), which goes past anyio's shields, is caught and
    raised again once they are done. ``asyncio.wait`` leaves the futures alone when the
    wait is cancelled (awaiting one directly would cancel it).
    """
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    overdue = False
    cancelled: asyncio.CancelledError | None = None
    with anyio.CancelScope(shield=True):
        while not all(future.done() for future in futures):
            left = None if deadline is None or overdue else deadline - loop.time()
            try:
                await asyncio.wait(futures, timeout=left)
            except asyncio.CancelledError as exc:
                cancelled = exc
                continue
            if not all(future.done() for future in futures):
                overdue = True
                log.error("copy_overdue", timeout=timeout)
    if cancelled is not None:
        raise cancelled
    return overdue


def _finish(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _fail(future: asyncio.Future[None], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class _Countdown:
    """Wakes the task awaiting :meth:`wait` once ``parts`` parts of a copy have ended,
    from the thread that ends last: one wake-up of the loop for the whole copy, where a
    future per part wakes it once per part (each wake-up costs tens to hundreds of
    microseconds when the loop's thread sleeps)."""

    __slots__ = ("_done", "_left", "_lock", "_loop", "errors")

    def __init__(self, loop: asyncio.AbstractEventLoop, parts: int) -> None:
        self._loop = loop
        self._left = parts
        self._lock = threading.Lock()
        self._done: asyncio.Future[None] = loop.create_future()
        self.errors: list[BaseException] = []  # in the order the parts failed

    def run(self, work: Callable[[list[J]], None], jobs: list[J]) -> None:
        """One part, on a copy thread."""
        try:
            work(jobs)
        except BaseException as exc:  # every failure goes to the awaiting task
            self.fail(exc)
        else:
            self._end()

    def fail(self, exc: BaseException) -> None:
        """End a part with ``exc`` (it failed, or could not start)."""
        self.errors.append(exc)
        self._end()

    def _end(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        _finish(self._done)  # the future awaited now (a cancellation may have replaced it)

    async def wait(self) -> None:
        """Return once every part has ended, whatever happens to this task meanwhile: the
        memory the parts write is handed back next.

        AnyIO cancellation is held off by a shield. asyncio's own (``task.cancel()``,
        ``asyncio.timeout``, ``wait_for``) goes past anyio's shields: it is caught, and
        raised again once the parts have ended. Such a cancellation cancels the future
        awaited, so a new one takes its place for the thread's wake-up. (Not
        :func:`wait_out`: its ``asyncio.wait`` costs the loop one more pass per copy.)
        """
        cancelled: asyncio.CancelledError | None = None
        with anyio.CancelScope(shield=True):
            while self._left:
                try:
                    await self._done
                except asyncio.CancelledError as exc:
                    cancelled = exc
                    if self._done.cancelled():
                        self._done = self._loop.create_future()
        if cancelled is not None:
            raise cancelled


class Transfers:
    """Runs gathers/scatters where they belong for the device of the KV caches.

    A copy is ``work(jobs)``: a callable over a list of per-chunk jobs. On the CPU, copies
    of fewer than ``inline_bytes`` run on the event loop (a thread hop costs more than
    they do); larger ones are split across ``workers`` copy threads, each running torch
    with one intra-op thread, so two cores copy two chunks at once instead of contending
    inside each small copy. On CUDA every copy goes to the direction's stream.
    """

    def __init__(self, *, inline_bytes: int, workers: int | None = None) -> None:
        self._inline_bytes = inline_bytes
        self._workers = max(1, workers if workers is not None else torch.get_num_threads())
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._streams: dict[tuple[torch.device, Direction], Any] = {}
        self._bridges: dict[tuple[torch.device, Direction], EventBridge] = {}
        self._closed = False

    async def run(
        self,
        work: Callable[[list[J]], None],
        jobs: list[J],
        *,
        device: torch.device,
        direction: Direction,
        nbytes: int,
        timeout: float,
    ) -> None:
        """Run ``work(jobs)`` and return when the copies have completed.

        CPU copies are not interrupted once started, even if the caller is cancelled: the
        memory they write to must not be handed back before they finish.

        Raises:
            TimeoutError: a GPU copy did not complete within ``timeout`` seconds.
            EngineClosedError: after :meth:`close`.
        """
        if self._closed:
            raise EngineClosedError("transfers are closed")
        if device.type == "cuda":
            await self._run_cuda(functools.partial(work, jobs), device, direction, timeout)
        elif nbytes < self._inline_bytes:
            work(jobs)
        else:
            await self._run_threads(work, jobs)

    async def _run_threads(self, work: Callable[[list[J]], None], jobs: list[J]) -> None:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=self._workers,
                thread_name_prefix="lmcache-copy",
                initializer=torch.set_num_threads,  # per thread: the caller's setting stays
                initargs=(1,),
            )
        split = min(self._workers, len(jobs))
        countdown = _Countdown(asyncio.get_running_loop(), split)
        for i in range(split):
            try:
                self._executor.submit(countdown.run, work, jobs[i::split])
            except RuntimeError as exc:  # the executor was shut down meanwhile
                countdown.fail(exc)
        await countdown.wait()
        if countdown.errors:
            raise countdown.errors[0]

    async def _run_cuda(
        self, fn: Callable[[], None], device: torch.device, direction: Direction, timeout: float
    ) -> None:
        key = (device, direction)
        stream = self._streams.get(key)
        if stream is None:
            stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            self._streams[key] = stream
            self._bridges[key] = EventBridge(f"{direction.value}-{device}")
        # Order the copy after work already queued on the caller's stream: for a store, the
        # serving engine's writes of the KV; for both, the request's row indices, which
        # were computed there when the request was prepared.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        await self._bridges[key].wait(event, timeout=timeout)

    def close(self) -> None:
        """Stop the copy and bridge threads; further copies raise EngineClosedError."""
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        for bridge in self._bridges.values():
            bridge.close()
        self._bridges.clear()
        self._streams.clear()
