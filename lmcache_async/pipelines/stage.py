"""Pipeline plumbing: stages as actors joined by bounded memory-object streams.

A stage implements ``async def run(receive, send)``: it reads items until its input stream
is closed and writes to the next stage. It does not know its neighbours. :class:`Pipeline`
creates the bounded streams, starts every stage in one task group and is an async context
manager; closing its input is how it shuts down (end of stream is a closed stream, never a
sentinel). Each item belongs to a request whose :class:`Completion` the last stage resolves.

A stage that does its work per item in ``async def handle(item, emit)`` (an
:class:`ItemStage`; its ``run`` is :func:`drive`) can also run in the caller's task:
:meth:`Pipeline.run_inline` passes one item through every stage, depth first, with no
stream and no task hop. The engine does that for small requests, whose work is short and
does not wait.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from lmcache_async.logging import get_logger

from ..errors import EngineClosedError

__all__ = ["Completion", "Emit", "ItemStage", "Pipeline", "Stage", "drive", "items", "put"]

log = get_logger(__name__)

T = TypeVar("T")


class Completion(Generic[T]):
    """The result of one request, set once by whichever stage finishes or fails it."""

    __slots__ = ("_done", "_error", "_result")

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._result: T | None = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def set_result(self, result: T) -> None:
        if not self._done.is_set():
            self._result = result
            self._done.set()

    def set_error(self, error: BaseException) -> None:
        if not self._done.is_set():
            self._error = error
            self._done.set()

    async def wait(self) -> T:
        """Wait for the request to finish; re-raises the error it failed with."""
        await self._done.wait()
        return self.result()

    async def wait_done(self) -> None:
        """Wait for the request to finish, whatever its outcome; never raises it."""
        await self._done.wait()

    def result(self) -> T:
        if self._error is not None:
            raise self._error
        if not self._done.is_set():
            raise RuntimeError("the request has not finished")
        return self._result  # type: ignore[return-value]


class items(Generic[T]):  # a function in use: `async for x in items(receive)`
    """Iterate over a stage's input until it is closed.

    An item already buffered is taken without yielding to the event loop (anyio's
    ``receive`` always yields first); the stage still yields whenever it has to wait, so a
    pipeline hop costs no extra loop iteration when work is queued.
    """

    __slots__ = ("_receive",)

    def __init__(self, receive: MemoryObjectReceiveStream[T]) -> None:
        self._receive = receive

    def __aiter__(self) -> items[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return self._receive.receive_nowait()
        except anyio.WouldBlock:
            try:
                return await self._receive.receive()
            except anyio.EndOfStream:
                raise StopAsyncIteration from None
        except anyio.EndOfStream:
            raise StopAsyncIteration from None


async def put(send: MemoryObjectSendStream[T], item: T) -> None:
    """Hand ``item`` to the next stage, waiting only when its buffer is full."""
    try:
        send.send_nowait(item)
    except anyio.WouldBlock:
        await send.send(item)


Emit = Callable[[Any], Awaitable[None]]
"""How a stage hands an item on: into the next stage's stream, or straight to its
``handle`` when the pipeline runs inline."""


class Stage(Protocol):
    """One step of a pipeline: consume ``receive`` until closed, produce into ``send``.

    A stage closes ``send`` when it returns (``async with receive, send:``), which ends the
    next stage in turn.
    """

    name: str

    async def run(
        self, receive: MemoryObjectReceiveStream[Any], send: MemoryObjectSendStream[Any]
    ) -> None: ...


class ItemStage(Protocol):
    """A stage whose work is per item: ``handle`` does it and emits what goes on (``run``
    is :func:`drive`). Only such stages can run inline."""

    name: str

    async def handle(self, item: Any, emit: Emit) -> None: ...


async def drive(
    stage: ItemStage, receive: MemoryObjectReceiveStream[Any], send: MemoryObjectSendStream[Any]
) -> None:
    """An item stage's ``run``: handle each input item, emitting into ``send``, until the
    input is closed; then close ``send``."""

    async def emit(item: Any) -> None:
        await put(send, item)

    async with receive, send:
        async for item in items(receive):
            await stage.handle(item, emit)


async def _emit_nothing(item: Any) -> None:
    raise RuntimeError(f"the last stage of a pipeline emitted {type(item).__name__}")


class Pipeline:
    """Builds and runs a chain of stages joined by streams of ``buffer_size`` items each.

    ``async with Pipeline(name, stages, buffer_size=8) as pipe: await pipe.submit(item)``.
    On exit the input is closed and the stages drain what is queued before they stop.
    """

    def __init__(self, name: str, stages: Sequence[Stage], *, buffer_size: int) -> None:
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        self.name = name
        self._stages = list(stages)
        self._buffer_size = buffer_size
        self._input: MemoryObjectSendStream[Any] | None = None
        self._task_group: TaskGroup | None = None
        self._failed: BaseException | None = None
        self._live_stages = 0
        self._stopped = anyio.Event()

    @property
    def running(self) -> bool:
        return self._input is not None and self._failed is None

    async def submit(self, item: Any) -> None:
        """Queue ``item`` for the first stage, waiting while the pipeline is full.

        Raises EngineClosedError when the pipeline is not running.
        """
        if self._input is None or self._failed is not None:
            raise EngineClosedError(f"the {self.name} pipeline is not running")
        try:
            await self._input.send(item)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            raise EngineClosedError(f"the {self.name} pipeline is not running") from exc

    async def run_inline(self, item: Any) -> None:
        """Pass ``item`` through every stage in the caller's task: each stage's ``handle``
        calls the next one's for what it emits, so when this returns every item derived
        from ``item`` has been through the last stage. The stages must be
        :class:`ItemStage` s. Use it for work that is short and does not wait: the caller
        does it, and a cancellation of the caller lands inside a stage.

        Raises EngineClosedError when the pipeline is not running.
        """
        if self._input is None or self._failed is not None:
            raise EngineClosedError(f"the {self.name} pipeline is not running")
        await self._handle_at(0, item)

    async def _handle_at(self, index: int, item: Any) -> None:
        stage: ItemStage = self._stages[index]  # type: ignore[assignment]
        if index + 1 == len(self._stages):
            await stage.handle(item, _emit_nothing)
        else:
            await stage.handle(item, functools.partial(self._handle_at, index + 1))

    async def __aenter__(self) -> Pipeline:
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        send, receive = anyio.create_memory_object_stream[Any](self._buffer_size)
        self._input = send
        self._live_stages = len(self._stages)
        for index, stage in enumerate(self._stages):
            last = index == len(self._stages) - 1
            size = 0 if last else self._buffer_size
            next_send, next_receive = anyio.create_memory_object_stream[Any](size)
            task_group.start_soon(self._run_stage, stage, receive, next_send, name=stage.name)
            receive = next_receive
        # Nothing consumes the last stage's output; closing the receiver makes a stray send
        # fail loudly instead of blocking.
        receive.close()
        self._task_group = task_group
        return self

    async def _run_stage(
        self,
        stage: Stage,
        receive: MemoryObjectReceiveStream[Any],
        send: MemoryObjectSendStream[Any],
    ) -> None:
        try:
            await stage.run(receive, send)
        except Exception as exc:
            self._failed = exc
            log.exception("pipeline_stage_crashed", pipeline=self.name, stage=stage.name)
            raise
        finally:
            self._live_stages -= 1
            if self._live_stages == 0:
                self._stopped.set()

    async def wait_stopped(self) -> None:
        """Wait until every stage has returned (after :meth:`aclose`, once drained)."""
        if self._task_group is None:
            return
        await self._stopped.wait()

    async def aclose(self) -> None:
        """Stop accepting items; the stages finish what is queued and return."""
        if self._input is not None:
            self._input.close()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        await self.aclose()
        task_group, self._task_group = self._task_group, None
        if task_group is None:
            return None
        return await task_group.__aexit__(exc_type, exc, tb)
