"""Where copies run: the CUDA event bridge (driven by stand-in events), the CPU paths, and
the CUDA path's order of calls (driven by stand-in streams and events)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from lmcache_async.errors import EngineClosedError, InvalidInputError
from lmcache_async.transfer.cuda import Direction, EventBridge, Transfers, caller_stream
from tests.fake_cuda import CUDA, FakeCuda, install

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


async def test_copy_threads_started_ahead_serve_the_first_copy_and_end_on_close() -> None:
    def copy_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("lmcache-copy")]

    transfers = Transfers(inline_bytes=1000, workers=3)
    assert copy_threads() == []  # none before they are asked for
    try:
        transfers.start_threads()
        started = copy_threads()
        assert len(started) == 3
        transfers.start_threads()  # a second call starts no more
        seen: set[str] = set()

        def work(jobs: list[int]) -> None:
            seen.add(threading.current_thread().name)

        with anyio.fail_after(5):
            await transfers.run(
                work, [1, 2, 3], device=CPU, direction=Direction.STORE, nbytes=5000, timeout=5
            )
        assert seen and seen <= {t.name for t in started}  # the first copy ran on them
        assert copy_threads() == started  # and started none
    finally:
        transfers.close()
    assert copy_threads() == []
    with pytest.raises(EngineClosedError):
        transfers.start_threads()


async def test_a_copy_that_spreads_itself_runs_whole_in_one_copy_thread() -> None:
    transfers = Transfers(inline_bytes=1000, workers=2)
    seen: list[tuple[str, list[int]]] = []

    def work(jobs: list[int]) -> None:
        seen.append((threading.current_thread().name, list(jobs)))

    try:
        with anyio.fail_after(5):
            await transfers.run(
                work,
                [1, 2, 3, 4],
                device=CPU,
                direction=Direction.STORE,
                nbytes=5000,
                timeout=5,
                split=False,
            )
        assert len(seen) == 1
        assert seen[0][0].startswith("lmcache-copy") and seen[0][1] == [1, 2, 3, 4]
    finally:
        transfers.close()


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


# ------------------------------------------------- the CUDA path, with stand-in streams


def copy_stream_of(cuda: FakeCuda) -> str:
    """The name of the stream the (one) copy ran on."""
    return next(entry[1] for entry in cuda.log if entry[0] == "work")


@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
async def test_a_cuda_copy_follows_the_callers_point(
    monkeypatch: pytest.MonkeyPatch, direction: Direction
) -> None:
    """The copy stream waits for the point recorded on the caller's stream (and for the
    plan, built on this thread's stream) before the copy; a load's event then comes
    before the caller's next work. All on the loop: the host memory is pinned."""
    cuda = install(monkeypatch)
    caller_side = cuda.Stream(name="caller")
    caller = caller_stream(CUDA, caller_side)
    assert caller is not None and caller.stream is caller_side
    transfers = Transfers(inline_bytes=0, host_pinned=True)
    try:
        with anyio.fail_after(5):
            await transfers.run(
                cuda.work,
                [1],
                device=CUDA,
                direction=direction,
                nbytes=1,
                timeout=5,
                caller=caller,
            )
    finally:
        transfers.close()
    copy = copy_stream_of(cuda)
    loop_thread = threading.current_thread().name
    recorded = {stream: event for kind, event, stream in cuda.log if kind == "record"}
    ready, built, done = recorded["caller"], recorded["default"], recorded[copy]
    expected = [
        ("record", built, "default"),
        ("record", ready, "caller"),
        ("wait", copy, ready),
        ("wait", copy, built),
        ("work", copy, loop_thread),
        ("record", done, copy),
    ]
    if direction is Direction.LOAD:
        expected.append(("wait", "caller", done))
    assert cuda.log == expected
    assert cuda.synced == [done]  # awaited through the bridge


async def test_a_cuda_copy_without_a_caller_follows_the_current_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = install(monkeypatch)
    transfers = Transfers(inline_bytes=0, host_pinned=True)
    try:
        with anyio.fail_after(5):
            await transfers.run(
                cuda.work, [1], device=CUDA, direction=Direction.LOAD, nbytes=1, timeout=5
            )
    finally:
        transfers.close()
    copy = copy_stream_of(cuda)
    ready = cuda.log[0][1]
    assert cuda.log[:3] == [
        ("record", ready, "default"),
        ("wait", copy, ready),
        ("work", copy, threading.current_thread().name),
    ]
    assert cuda.log[-1][:2] == ("wait", "default")  # the current stream reads the load


@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
async def test_cuda_copies_of_unpinned_memory_are_queued_off_the_loop(
    monkeypatch: pytest.MonkeyPatch, direction: Direction
) -> None:
    """A "non_blocking" copy to or from unpinned memory is synchronous: it must not run
    on the event loop's thread."""
    cuda = install(monkeypatch)
    transfers = Transfers(inline_bytes=1 << 30, host_pinned=False)
    try:
        with anyio.fail_after(5):
            await transfers.run(
                cuda.work,
                [1],
                device=CUDA,
                direction=direction,
                nbytes=1,
                timeout=5,
                caller=caller_stream(CUDA),
            )
    finally:
        transfers.close()
    (work,) = [entry for entry in cuda.log if entry[0] == "work"]
    assert work[2].startswith("lmcache-copy")
    assert transfers.host_pinned is False


async def test_a_cuda_copy_that_fails_after_queueing_waits_for_its_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When recording the copy's event fails, the copies queued are waited for before
    the error reaches the caller (who hands the memory back then)."""
    cuda = install(monkeypatch)
    caller = caller_stream(CUDA)
    transfers = Transfers(inline_bytes=0, host_pinned=True)
    cuda.fail_record = 1
    try:
        with anyio.fail_after(5), pytest.raises(RuntimeError, match="record failed"):
            await transfers.run(
                cuda.work,
                [1],
                device=CUDA,
                direction=Direction.LOAD,
                nbytes=1,
                timeout=5,
                caller=caller,
            )
    finally:
        transfers.close()
    copy = copy_stream_of(cuda)
    assert cuda.log[-2:] == [("work", copy, threading.current_thread().name), ("sync", copy)]


async def test_a_cuda_copy_closed_under_waits_for_its_event_then_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = install(monkeypatch)
    transfers = Transfers(inline_bytes=0, host_pinned=True)

    def work_then_close(jobs: list[int]) -> None:
        cuda.work(jobs)
        transfers.close()  # the bridges close between the copy and its wait

    with anyio.fail_after(5), pytest.raises(EngineClosedError):
        await transfers.run(
            work_then_close, [1], device=CUDA, direction=Direction.STORE, nbytes=1, timeout=5
        )
    done = cuda.log[-1][1]
    assert cuda.log[-1] == ("record", done, copy_stream_of(cuda))
    assert cuda.synced == [done]  # waited for, on a bridge of its own
    assert not [t for t in threading.enumerate() if t.name.startswith("cuda-bridge")]


@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
async def test_a_staged_cuda_copy_runs_on_the_lanes_of_its_direction(
    monkeypatch: pytest.MonkeyPatch, direction: Direction
) -> None:
    """run_staged hands the work the direction's lanes: home is the stream the copy is
    ordered on and its completion recorded on; side is a second stream; two buffers."""
    cuda = install(monkeypatch)
    transfers = Transfers(inline_bytes=0, host_pinned=True)
    seen: list[Any] = []

    def work(jobs: list[int], lanes: Any) -> None:
        seen.append((lanes, cuda.current_stream().name))

    try:
        with anyio.fail_after(5):
            await transfers.run_staged(
                work, [1], device=CUDA, direction=direction, timeout=5, caller=caller_stream(CUDA)
            )
        lanes = transfers.lanes(CUDA, direction)
        assert seen == [(lanes, lanes.home.name)]
        assert lanes.side is not lanes.home and lanes.slots[0] is not lanes.slots[1]
        assert transfers.staging(CUDA, direction) is lanes.slots[0]
        assert (
            transfers.lanes(
                CUDA, Direction.LOAD if direction is Direction.STORE else Direction.STORE
            )
            is not lanes
        )
        done = next(e[1] for e in cuda.log if e[0] == "record" and e[2] == lanes.home.name)
        assert cuda.synced == [done]
        assert (cuda.log[-1] == ("wait", "default", done)) is (direction is Direction.LOAD)
    finally:
        transfers.close()
    assert all(slot.closed for slot in lanes.slots)


async def test_a_queued_copy_returns_before_it_completes_and_leaves_the_order_to_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """queue() returns the copy's event without waiting on the host; a handed-over caller's
    stream is not made to wait (the caller consumes the event itself, later)."""
    cuda = install(monkeypatch)
    transfers = Transfers(inline_bytes=0, host_pinned=True)
    caller = caller_stream(CUDA)
    assert caller is not None
    try:
        with cuda.held(), anyio.fail_after(5):
            queued = await transfers.queue(
                cuda.work,
                [1],
                device=CUDA,
                direction=Direction.LOAD,
                timeout=5,
                caller=caller.handed_over(),
            )
            assert cuda.synced == []
            assert not [e for e in cuda.log if e[:2] == ("wait", "default")]
            caller.consume(queued.event)
            assert cuda.log[-1] == ("wait", "default", queued.event.name)
        with anyio.fail_after(5):
            await queued.wait()
        assert cuda.synced == [queued.event.name]
        with pytest.raises(InvalidInputError, match="expected a CUDA device"):
            await transfers.queue(cuda.work, [1], device=CPU, direction=Direction.LOAD, timeout=5)
    finally:
        transfers.close()
