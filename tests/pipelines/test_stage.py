"""The pipeline plumbing: order, back-pressure, end of stream, crash reporting."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from lmcache_async.errors import EngineClosedError
from lmcache_async.pipelines.stage import Completion, Pipeline

pytestmark = pytest.mark.anyio


class Add:
    def __init__(self, name: str, amount: int, seen: list[Any] | None = None) -> None:
        self.name = name
        self.amount = amount
        self.seen = seen

    async def run(
        self, receive: MemoryObjectReceiveStream[Any], send: MemoryObjectSendStream[Any]
    ) -> None:
        async with receive, send:
            async for value, done in receive:
                if self.seen is not None:
                    self.seen.append(value)
                await send.send((value + self.amount, done))


class Finish:
    name = "finish"

    async def run(
        self, receive: MemoryObjectReceiveStream[Any], send: MemoryObjectSendStream[Any]
    ) -> None:
        async with receive, send:
            async for value, done in receive:
                done.set_result(value)


class Gate:
    """Holds every item until released, to observe back-pressure."""

    name = "gate"

    def __init__(self) -> None:
        self.release = anyio.Event()
        self.entered = 0

    async def run(
        self, receive: MemoryObjectReceiveStream[Any], send: MemoryObjectSendStream[Any]
    ) -> None:
        async with receive, send:
            async for item in receive:
                self.entered += 1
                await self.release.wait()
                await send.send(item)


async def test_items_flow_through_every_stage_in_order() -> None:
    seen: list[int] = []
    with anyio.fail_after(5):
        async with Pipeline(
            "t", [Add("a", 1), Add("b", 10, seen), Finish()], buffer_size=2
        ) as pipe:
            completions = [Completion[int]() for _ in range(20)]
            for i, done in enumerate(completions):
                await pipe.submit((i, done))
            results = [await done.wait() for done in completions]
    assert results == [i + 11 for i in range(20)]
    assert seen == [i + 1 for i in range(20)]


async def test_bounded_streams_apply_back_pressure() -> None:
    """A full pipeline holds its submitter: with the first stage stuck, one item is inside
    it and one in its input buffer, and the third ``submit`` waits until the stage moves."""
    gate = Gate()
    submitted = 0
    with anyio.fail_after(5):
        async with Pipeline("t", [gate, Add("a", 0), Finish()], buffer_size=1) as pipe:
            completions = [Completion[int]() for _ in range(10)]

            async def submit_all() -> None:
                nonlocal submitted
                for i, done in enumerate(completions):
                    await pipe.submit((i, done))
                    submitted += 1

            async with anyio.create_task_group() as tg:
                tg.start_soon(submit_all)
                await anyio.wait_all_tasks_blocked()  # every task waits: nothing more fits
                assert gate.entered == 1
                assert submitted == 2
                gate.release.set()
            assert submitted == len(completions)
            assert [await done.wait() for done in completions] == list(range(10))


async def test_submit_after_close_raises_engine_closed() -> None:
    pipe = Pipeline("t", [Finish()], buffer_size=1)
    with pytest.raises(EngineClosedError):
        await pipe.submit((1, Completion[int]()))
    with anyio.fail_after(5):
        async with pipe:
            await pipe.aclose()
            await pipe.wait_stopped()
            with pytest.raises(EngineClosedError):
                await pipe.submit((1, Completion[int]()))


async def test_completion_reraises_the_request_error() -> None:
    done = Completion[int]()
    done.set_error(KeyError("x"))
    done.set_result(3)  # ignored: the first outcome wins
    with pytest.raises(KeyError):
        await done.wait()


async def test_a_crashing_stage_marks_the_pipeline_not_running() -> None:
    class Boom:
        name = "boom"

        async def run(
            self, receive: MemoryObjectReceiveStream[Any], send: MemoryObjectSendStream[Any]
        ) -> None:
            async with receive, send:
                async for _ in receive:
                    raise RuntimeError("stage bug")

    pipe = Pipeline("t", [Boom()], buffer_size=1)
    with anyio.fail_after(5), pytest.raises(BaseExceptionGroup) as info:
        async with pipe:
            await pipe.submit(1)
            await anyio.sleep_forever()
    assert info.group_contains(RuntimeError, match="stage bug")
    assert not pipe.running
