"""Where copies run: the CUDA event bridge (driven by stand-in events) and the CPU paths."""

from __future__ import annotations

import asyncio
import threading

import anyio
import anyio.lowlevel
import pytest
import torch

from lmcache_async.cuda import Direction, EventBridge, Transfers
from lmcache_async.errors import EngineClosedError

pytestmark = pytest.mark.anyio

CPU = torch.device("cpu")


class HeldEvent:
    """Stands in for a torch.cuda.Event: synchronize() blocks until released."""

    def __init__(self, error: Exception | None = None) -> None:
        self.released = threading.Event()
        self.error = error

    def synchronize(self) -> None:
        self.released.wait(timeout=10)
        if self.error is not None:
            raise self.error


async def test_bridge_wakes_the_waiter_when_the_event_completes() -> None:
    bridge = EventBridge("test")
    try:
        event = HeldEvent()
        done = anyio.Event()

        async def waiter() -> None:
            await bridge.wait(event, timeout=5)
            done.set()

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await anyio.wait_all_tasks_blocked()
                assert not done.is_set()  # the loop is free while the "GPU" works
                event.released.set()
        assert done.is_set()
    finally:
        bridge.close()


async def test_bridge_reports_device_errors_and_timeouts() -> None:
    bridge = EventBridge("test")
    try:
        failing = HeldEvent(RuntimeError("device fault"))
        failing.released.set()
        with anyio.fail_after(5), pytest.raises(RuntimeError, match="device fault"):
            await bridge.wait(failing, timeout=5)
        # An overdue copy is reported as a timeout only once it has completed: its host
        # memory must not be reused while the device may still touch it.
        stuck = HeldEvent()
        outcome: list[str] = []

        async def waiter() -> None:
            try:
                await bridge.wait(stuck, timeout=0.05)
            except TimeoutError:
                outcome.append("timeout")

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await anyio.sleep(0.3)  # well past the timeout: the scenario, not a race
                assert outcome == []
                stuck.released.set()
        assert outcome == ["timeout"]
    finally:
        bridge.close()
    with pytest.raises(EngineClosedError):
        await bridge.wait(HeldEvent(), timeout=1)


async def test_small_copies_run_inline_and_large_ones_on_copy_threads() -> None:
    transfers = Transfers(inline_bytes=1000, workers=2)
    seen: list[tuple[str, list[int]]] = []

    def work(jobs: list[int]) -> None:
        seen.append((threading.current_thread().name, list(jobs)))

    with anyio.fail_after(5):
        await transfers.run(
            work, [1, 2], device=CPU, direction=Direction.STORE, nbytes=10, timeout=5
        )
        assert seen == [(threading.current_thread().name, [1, 2])]
        seen.clear()
        await transfers.run(
            work, [1, 2, 3, 4, 5], device=CPU, direction=Direction.LOAD, nbytes=5000, timeout=5
        )
    # split round-robin over the two copy threads, every job exactly once
    assert sorted(job for _, jobs in seen for job in jobs) == [1, 2, 3, 4, 5]
    assert len(seen) == 2
    assert all(name.startswith("lmcache-copy") for name, _ in seen)
    transfers.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("lmcache-copy")]
    with pytest.raises(EngineClosedError):
        await transfers.run(work, [1], device=CPU, direction=Direction.LOAD, nbytes=1, timeout=1)


async def test_copy_thread_failure_reaches_the_caller() -> None:
    transfers = Transfers(inline_bytes=0, workers=2)

    def work(jobs: list[int]) -> None:
        if 2 in jobs:
            raise ValueError("bad copy")

    try:
        with anyio.fail_after(5), pytest.raises(ValueError, match="bad copy"):
            await transfers.run(
                work, [1, 2], device=CPU, direction=Direction.STORE, nbytes=1, timeout=5
            )
    finally:
        transfers.close()


async def test_a_failed_part_is_raised_only_once_every_part_has_ended() -> None:
    """The caller hands the copy's memory back when run() returns or raises: never while
    another part still writes it, even when one part failed at once."""
    transfers = Transfers(inline_bytes=0, workers=2)
    failed, release = threading.Event(), threading.Event()
    ended: list[int] = []

    def work(jobs: list[int]) -> None:
        if jobs == [1]:
            failed.set()
            raise ValueError("bad copy")
        release.wait(10)
        ended.append(jobs[0])

    outcome: list[str] = []

    async def caller() -> None:
        with pytest.raises(ValueError, match="bad copy"):
            await transfers.run(
                work, [1, 2], device=CPU, direction=Direction.STORE, nbytes=1, timeout=5
            )
        outcome.append(f"raised after {ended}")

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(caller)
                await anyio.to_thread.run_sync(failed.wait)
                for _ in range(20):  # let the loop run whatever the failure scheduled
                    await anyio.lowlevel.checkpoint()
                assert outcome == []
                release.set()
        assert outcome == ["raised after [2]"]
    finally:
        release.set()
        transfers.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("lmcache-copy")]


async def test_every_part_failing_raises_one_of_their_errors() -> None:
    transfers = Transfers(inline_bytes=0, workers=2)

    def work(jobs: list[int]) -> None:
        raise ValueError(f"bad copy {jobs}")

    try:
        with anyio.fail_after(5), pytest.raises(ValueError, match=r"bad copy \[[12]\]"):
            await transfers.run(
                work, [1, 2], device=CPU, direction=Direction.LOAD, nbytes=1, timeout=5
            )
        # The copy threads are still usable after the failures.
        seen: list[int] = []
        with anyio.fail_after(5):
            await transfers.run(
                seen.extend, [3, 4], device=CPU, direction=Direction.LOAD, nbytes=1, timeout=5
            )
        assert sorted(seen) == [3, 4]
    finally:
        transfers.close()


async def test_asyncio_cancellation_waits_for_the_copy_threads_then_is_raised() -> None:
    """asyncio's own cancellation (task.cancel(), as asyncio.timeout and wait_for use)
    goes past anyio's shields: a copy still must end before run() gives up its memory."""
    transfers = Transfers(inline_bytes=0, workers=2)
    started, release = threading.Barrier(3), threading.Event()
    ended: list[int] = []

    def work(jobs: list[int]) -> None:
        started.wait(10)
        release.wait(10)
        ended.append(jobs[0])

    try:
        with anyio.fail_after(10):
            task = asyncio.ensure_future(
                transfers.run(
                    work, [1, 2], device=CPU, direction=Direction.STORE, nbytes=1, timeout=5
                )
            )
            await anyio.to_thread.run_sync(started.wait, 10)
            task.cancel()
            for _ in range(20):
                await anyio.lowlevel.checkpoint()
            assert not task.done()
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert sorted(ended) == [1, 2]
    finally:
        release.set()
        transfers.close()


async def test_asyncio_cancellation_waits_for_a_cuda_event_then_is_raised() -> None:
    bridge = EventBridge("test")
    held = HeldEvent()
    try:
        with anyio.fail_after(10):
            task = asyncio.ensure_future(bridge.wait(held, timeout=5))
            for _ in range(5):
                await anyio.lowlevel.checkpoint()
            task.cancel()
            for _ in range(20):
                await anyio.lowlevel.checkpoint()
            assert not task.done()
            held.released.set()
            with pytest.raises(asyncio.CancelledError):
                await task
    finally:
        held.released.set()
        bridge.close()
