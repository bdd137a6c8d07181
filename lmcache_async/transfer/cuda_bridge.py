"""Waiting on the GPU from the event loop: :class:`EventBridge` and :func:`wait_out`.

A copy queued on a CUDA stream is followed by an event; the task that queued it awaits
that event through an :class:`EventBridge`: one waiter thread per stream blocks in
``Event.synchronize()`` and wakes the awaiting task with ``call_soon_threadsafe``, so the
event loop never blocks on the GPU and no thread is held per copy.

The waiter thread outlives whatever happens to one wait: a device error goes to its waiter,
a waiter whose event loop has closed is dropped (nobody is left to wake) and the thread
goes on with the next event. A wait outlasts its timeout only while the thread is alive
(the device still holds the copy's memory); once nothing can end it, it ends with
TimeoutError, never a hang.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
from collections.abc import Callable, Collection
from typing import Any, Final

import anyio

from lmcache_async.errors import EngineClosedError
from lmcache_async.logging import get_logger

__all__ = ["EventBridge", "wait_out"]

log = get_logger(__name__)

_RECHECK_SECONDS: Final = 0.01
"""The shortest period at which an overdue wait asks whether anything can still end it."""

_Job = tuple[Any, asyncio.AbstractEventLoop, "asyncio.Future[None]"]


class EventBridge:
    """Turns completion of CUDA events into awaitables on the running event loop.

    Events of one stream complete in the order they were recorded, so a single waiter
    thread serves a stream: it synchronizes on the oldest event and wakes its awaiter.
    An event is anything with ``synchronize()`` (a ``torch.cuda.Event``; tests use
    stand-ins).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        # Taken to queue a job or to close: no job can follow the thread's stop marker.
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=f"cuda-bridge-{name}", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the waiter thread runs (it stops only after :meth:`close`)."""
        return self._thread.is_alive()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._answer(*job)

    def _answer(
        self, event: Any, loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]
    ) -> None:
        """Wait for one event and wake its waiter; nothing here may end the thread."""
        outcome: Callable[[], None]
        try:
            event.synchronize()
        except Exception as exc:  # a device error must reach the awaiting request
            outcome = functools.partial(_fail, future, exc)
        else:
            outcome = functools.partial(_finish, future)
        try:
            loop.call_soon_threadsafe(outcome)
        except RuntimeError:  # the waiter's loop is closed: nobody is left to wake
            log.warning("cuda_bridge_loop_closed", bridge=self._name)

    async def wait(self, event: Any, *, timeout: float) -> None:
        """Wait until ``event`` (a ``torch.cuda.Event``) has completed.

        Not interrupted by a cancellation, which is raised once the event has completed.
        An event that takes longer than ``timeout`` seconds is still waited for while the
        waiter thread runs: the memory of its copy is free to reuse only then.

        Raises:
            TimeoutError: the event took longer than ``timeout`` seconds (raised once it
                has completed), or it had not completed by then and the waiter thread
                had stopped, so nothing would ever end the wait.
            EngineClosedError: after :meth:`close`.
            Exception: the device error ``synchronize()`` raised.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._closed:
                raise EngineClosedError("the CUDA event bridge is closed")
            self._jobs.put((event, loop, future))
        if await wait_out((future,), timeout=timeout, still_running=self._thread.is_alive):
            # The copy was still queued on the device past the timeout; its host memory
            # could not be handed back before it completed. Fail the request now.
            raise TimeoutError(f"a CUDA copy took longer than {timeout} s")
        future.result()  # a device error

    def close(self) -> None:
        """Stop the waiter thread once the events already queued have completed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(None)
        self._thread.join()


async def wait_out(
    futures: Collection[asyncio.Future[Any]],
    *,
    timeout: float | None = None,
    still_running: Callable[[], bool] | None = None,
) -> bool:
    """Wait until every one of ``futures`` is done, whatever happens to this task
    meanwhile; returns whether that took longer than ``timeout`` seconds (logged then).

    The futures stand for copies touching memory that the caller hands back once this
    returns, so past ``timeout`` the wait goes on while ``still_running()`` says something
    will still end them (asked every ``timeout`` seconds). AnyIO cancellation is held off
    by a shield; asyncio's own (``task.cancel()``, ``asyncio.timeout``, ``wait_for``), which
    goes past anyio's shields, is caught and raised again once the wait is over.
    ``asyncio.wait`` leaves the futures alone when the wait is cancelled (awaiting one
    directly would cancel it).

    Raises:
        TimeoutError: ``timeout`` passed with a future still pending and nothing left to
            end it: no ``still_running`` was given, or it answered False.
    """
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    overdue = stranded = False
    cancelled: asyncio.CancelledError | None = None
    with anyio.CancelScope(shield=True):
        while not all(future.done() for future in futures):
            left = None if deadline is None else max(deadline - loop.time(), 0.0)
            try:
                await asyncio.wait(futures, timeout=left)
            except asyncio.CancelledError as exc:
                cancelled = exc
                continue
            if all(future.done() for future in futures) or deadline is None:
                continue
            if deadline > loop.time():
                continue  # woken early (a cancellation raced the wait): wait on
            if not overdue:
                overdue = True
                log.error("copy_overdue", timeout=timeout)
            if still_running is None or not still_running():
                stranded = True
                break
            assert timeout is not None  # a deadline comes from a timeout
            deadline = loop.time() + max(timeout, _RECHECK_SECONDS)
    if cancelled is not None:
        raise cancelled
    if stranded:
        log.error("copy_stranded", timeout=timeout)
        raise TimeoutError(
            f"a copy did not complete within {timeout} s and nothing is left to complete it"
        )
    return overdue


def _finish(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _fail(future: asyncio.Future[None], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
