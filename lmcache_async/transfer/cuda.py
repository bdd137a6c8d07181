"""Where copies run: inline, in a worker thread, or on a dedicated CUDA stream.

On CUDA a copy is queued on its own stream (one for loads, one for stores) after the point
of the caller's stream it must follow (:mod:`.cuda_streams`), an event is recorded behind
it, and the caller awaits that event through :class:`~.cuda_bridge.EventBridge`, so the
event loop never blocks on the GPU. A staged batch (:meth:`Transfers.run_staged`) also
gets a second stream and two staging buffers (:class:`~.pipelined.Lanes`), its kernels and
host copies overlapping; :meth:`Transfers.queue` queues a copy and hands back its event
(:class:`Queued`) for callers that order the caller's stream themselves (layerwise loads)
and await completion later. Copies to or from host memory that is not pinned are
synchronous whatever ``non_blocking`` says: they are queued from a copy thread instead of
the loop. On the CPU the bridge is not used: small copies run inline on the loop (a thread
hop costs more than they do) and large ones on a small pool of copy threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import functools
import threading
from collections.abc import Callable
from typing import Any, Final, TypeVar

import anyio
import torch

from lmcache_async.errors import EngineClosedError, InvalidInputError
from lmcache_async.transfer.cuda_bridge import EventBridge, wait_out
from lmcache_async.transfer.cuda_streams import CallerStream, caller_stream
from lmcache_async.transfer.pipelined import Lanes
from lmcache_async.transfer.staging import StagingBuffer

__all__ = [
    "CallerStream",
    "Direction",
    "EventBridge",
    "Lanes",
    "Queued",
    "Transfers",
    "caller_stream",
    "wait_out",
]

J = TypeVar("J")

_START_WAIT: Final = 10.0
"""Seconds a copy thread started ahead waits for the others to start (then it is free)."""


class Direction(enum.StrEnum):
    STORE = "store"  # engine memory -> host payload (D2H)
    LOAD = "load"  # host payload -> engine memory (H2D)


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
        if not self._done.done():  # the future awaited now (a cancellation may replace it)
            self._done.set_result(None)

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


class Queued:
    """A copy queued on a CUDA stream: ``event`` is recorded behind it (a load's caller
    stream may be made to wait for it: ``CallerStream.consume``), :meth:`wait` awaits its
    completion on the event loop."""

    __slots__ = ("_bridge", "_timeout", "event")

    def __init__(self, event: Any, bridge: EventBridge, timeout: float) -> None:
        self.event = event
        self._bridge = bridge
        self._timeout = timeout

    async def wait(self) -> None:
        """Return once the copy has completed, whatever happens to this task meanwhile
        (a cancellation is raised after it): its memory may be handed back then.

        Raises:
            TimeoutError: it took longer than the timeout it was queued with.
            EngineClosedError: the transfers were closed (raised once it completed).
        """
        try:
            await self._bridge.wait(self.event, timeout=self._timeout)
        except EngineClosedError:
            # Closed under this copy: its memory still goes back only once it completed.
            await _wait_alone(self.event, self._timeout)
            raise


class Transfers:
    """Runs gathers/scatters where they belong for the device of the KV caches.

    A copy is ``work(jobs)``: a callable over a list of per-chunk jobs. On the CPU, copies
    of fewer than ``inline_bytes`` run on the event loop (a thread hop costs more than
    they do); larger ones are split across ``workers`` copy threads, each running torch
    with one intra-op thread, so two cores copy two chunks at once instead of contending
    inside each small copy. On CUDA every copy goes to the direction's stream, queued on
    the loop when the host memory is pinned (``host_pinned``) and from a copy thread when
    it is not (a copy to or from unpinned memory blocks the thread that queues it).
    """

    def __init__(
        self, *, inline_bytes: int, workers: int | None = None, host_pinned: bool = False
    ) -> None:
        self._inline_bytes = inline_bytes
        self._workers = max(1, workers if workers is not None else torch.get_num_threads())
        self._host_pinned = host_pinned
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._streams: dict[tuple[torch.device, Direction], Any] = {}
        self._bridges: dict[tuple[torch.device, Direction], EventBridge] = {}
        self._lanes: dict[tuple[torch.device, Direction], Lanes] = {}
        self._closed = False

    @property
    def host_pinned(self) -> bool:
        """Whether the host side of the copies is pinned (CUDA copies queued on the loop)."""
        return self._host_pinned

    async def run(
        self,
        work: Callable[[list[J]], None],
        jobs: list[J],
        *,
        device: torch.device,
        direction: Direction,
        nbytes: int,
        timeout: float,
        caller: CallerStream | None = None,
        split: bool = True,
    ) -> None:
        """Run ``work(jobs)`` and return when the copies have completed. A large CPU copy
        is split by job over the copy threads, or with ``split`` False (a ``work`` that
        spreads its copies over threads itself) run whole in one of them.

        CPU copies are not interrupted once started, even if the caller is cancelled: the
        memory they write to must not be handed back before they finish. On CUDA the
        copies come after ``caller``'s point on its stream (None: the current stream, now),
        and a load's copies come before what the caller queues on its stream next.

        Raises:
            TimeoutError: a GPU copy did not complete within ``timeout`` seconds.
            EngineClosedError: after :meth:`close`.
        """
        if self._closed:
            raise EngineClosedError("transfers are closed")
        if device.type == "cuda":
            await self._run_cuda(functools.partial(work, jobs), device, direction, timeout, caller)
        elif nbytes < self._inline_bytes:
            work(jobs)
        else:
            await self._run_threads(work, jobs, split=split)

    async def run_staged(
        self,
        work: Callable[[list[J], Lanes], None],
        jobs: list[J],
        *,
        device: torch.device,
        direction: Direction,
        timeout: float,
        caller: CallerStream | None = None,
    ) -> None:
        """Run ``work(jobs, lanes)`` on a CUDA ``device`` with the direction's
        :class:`~.pipelined.Lanes` (``lanes.home`` current; ``work`` joins what it queues
        on ``lanes.side`` back into ``home``) and return when it has completed; ordered
        against ``caller`` as :meth:`run`.

        Raises:
            InvalidInputError: ``device`` is not a CUDA device.
            TimeoutError: it did not complete within ``timeout`` seconds.
            EngineClosedError: after :meth:`close`.
        """
        if device.type != "cuda":
            raise InvalidInputError(f"device: expected a CUDA device, got {device}")
        lanes = self.lanes(device, direction)
        await self._run_cuda(
            functools.partial(work, jobs, lanes), device, direction, timeout, caller
        )

    async def queue(
        self,
        work: Callable[[list[J]], None],
        jobs: list[J],
        *,
        device: torch.device,
        direction: Direction,
        timeout: float,
        caller: CallerStream | None = None,
    ) -> Queued:
        """Queue ``work(jobs)`` on the direction's stream of a CUDA ``device``, after
        ``caller``'s point (None: the current stream, now), and return without waiting
        for it: the caller awaits :meth:`Queued.wait` before handing its memory back. A
        load's caller stream is made to wait for it as :meth:`run` does, unless ``caller``
        was :meth:`~CallerStream.handed_over` (the caller then orders its stream itself,
        with ``Queued.event``).

        Raises:
            InvalidInputError: ``device`` is not a CUDA device.
            EngineClosedError: after :meth:`close`.
        """
        if device.type != "cuda":
            raise InvalidInputError(f"device: expected a CUDA device, got {device}")
        return await self._queued(functools.partial(work, jobs), device, direction, timeout, caller)

    def staging(self, device: torch.device, direction: Direction) -> StagingBuffer | None:
        """The first staging buffer of the direction's copies on a CUDA ``device`` (made
        on first use, freed by :meth:`close`), used on the direction's stream
        (:mod:`lmcache_async.transfer.staged`). None on the CPU.

        Raises:
            EngineClosedError: after :meth:`close`.
        """
        if device.type != "cuda":
            return None
        return self.lanes(device, direction).slots[0]

    def lanes(self, device: torch.device, direction: Direction) -> Lanes:
        """The direction's streams and staging buffers on a CUDA ``device`` (made on first
        use; the buffers are freed by :meth:`close`).

        Raises:
            EngineClosedError: after :meth:`close`.
        """
        if self._closed:
            raise EngineClosedError("transfers are closed")
        key = (device, direction)
        lanes = self._lanes.get(key)
        if lanes is None:
            home, _ = self._stream(device, direction)
            side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            slots = (StagingBuffer(device), StagingBuffer(device))
            lanes = self._lanes[key] = Lanes(home, side, slots)
        return lanes

    def start_threads(self) -> None:
        """Start every copy thread now (returns at once; they are otherwise started by
        the first copies that need them, whose time their start then adds to: about
        0.5 ms of a fresh engine's first 24 MiB store here). Each thread takes one task
        that waits for all of them, so that none is counted idle before the rest exist.

        Raises:
            EngineClosedError: after :meth:`close`.
        """
        if self._closed:
            raise EngineClosedError("transfers are closed")
        if self._executor is not None:
            return
        executor = self._executor_now()
        gate = threading.Barrier(self._workers, timeout=_START_WAIT)
        for _ in range(self._workers):
            executor.submit(gate.wait)  # a broken gate (a thread late) only ends the task

    def _executor_now(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=self._workers,
                thread_name_prefix="lmcache-copy",
                initializer=torch.set_num_threads,  # per thread: the caller's setting stays
                initargs=(1,),
            )
        return self._executor

    async def _run_threads(
        self, work: Callable[[list[J]], None], jobs: list[J], *, split: bool = True
    ) -> None:
        executor = self._executor_now()
        parts = min(self._workers, len(jobs)) if split else 1
        countdown = _Countdown(asyncio.get_running_loop(), parts)
        for i in range(parts):
            try:
                executor.submit(countdown.run, work, jobs[i::parts])
            except RuntimeError as exc:  # the executor was shut down meanwhile
                countdown.fail(exc)
        await countdown.wait()
        if countdown.errors:
            raise countdown.errors[0]

    async def _run_cuda(
        self,
        fn: Callable[[], None],
        device: torch.device,
        direction: Direction,
        timeout: float,
        caller: CallerStream | None,
    ) -> None:
        queued = await self._queued(fn, device, direction, timeout, caller)
        await queued.wait()

    async def _queued(
        self,
        fn: Callable[[], None],
        device: torch.device,
        direction: Direction,
        timeout: float,
        caller: CallerStream | None,
    ) -> Queued:
        """Queue ``fn`` on the direction's stream: on the loop when the host memory is
        pinned, else from a copy thread (a copy of unpinned memory blocks its thread).

        Raises:
            EngineClosedError: after :meth:`close`.
        """
        if self._closed:
            raise EngineClosedError("transfers are closed")
        stream, bridge = self._stream(device, direction)
        if caller is None:
            caller = caller_stream(device)
        assert caller is not None  # a CUDA device
        queue = functools.partial(_queue, fn, stream, caller, direction is Direction.LOAD)
        if self._host_pinned:
            event = queue()
        else:
            queued: list[Any] = []
            await self._run_threads(lambda _: queued.append(queue()), [None])
            event = queued[0]
        return Queued(event, bridge, timeout)

    def _stream(self, device: torch.device, direction: Direction) -> tuple[Any, EventBridge]:
        """The direction's copy stream on ``device`` and its bridge, made on first use.

        Raises:
            EngineClosedError: closed meanwhile (nothing was queued).
        """
        key = (device, direction)
        stream = self._streams.get(key)
        if stream is None:
            stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            self._streams[key] = stream
            self._bridges[key] = EventBridge(f"{direction.value}-{device}")
        bridge = self._bridges.get(key)
        if bridge is None:
            raise EngineClosedError("transfers are closed")
        return stream, bridge

    def close(self) -> None:
        """Stop the copy and bridge threads; further copies raise EngineClosedError."""
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        for bridge in list(self._bridges.values()):
            bridge.close()
        self._bridges.clear()
        for lanes in self._lanes.values():
            lanes.close()  # after the copies: their bridges waited for them
        self._lanes.clear()
        self._streams.clear()


def _queue(fn: Callable[[], None], stream: Any, caller: CallerStream, load: bool) -> Any:
    """Queue ``fn``'s copies on ``stream`` after the caller's point; returns the event
    recorded behind them, which a load's caller stream then waits for.

    ``fn`` (a :class:`~lmcache_async.transfer.plan.TransferPlan` transfer) waits for what it
    queued before it raises; a failure after it does the same here, so a caller that
    hands the memory back on an error never does so under a running copy.
    """
    caller.order(stream)
    with torch.cuda.stream(stream):
        fn()
    try:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        if load:
            caller.consume(event)
    except BaseException:
        stream.synchronize()
        raise
    return event


async def _wait_alone(event: Any, timeout: float) -> None:
    """Wait for ``event`` on a bridge of its own (the copy's was closed under it)."""
    bridge = EventBridge("closing")
    try:
        await bridge.wait(event, timeout=timeout)
    finally:
        bridge.close()
