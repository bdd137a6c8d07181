"""The CUDA event bridge when things go wrong, driven by stand-in events: a waiter's loop
closed under it, a waiter thread that stopped, and :func:`wait_out`'s timeout."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio
import pytest

from lmcache_async.transfer.cuda_bridge import EventBridge, wait_out

pytestmark = pytest.mark.anyio


class HeldEvent:
    """Stands in for a torch.cuda.Event: ``synchronize()`` blocks until released, then
    raises ``error`` if one is set; ``query()`` tells whether it was released."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.released = threading.Event()
        self.error = error
        self.waited = threading.Event()  # synchronize() was entered

    def query(self) -> bool:
        return self.released.is_set()

    def synchronize(self) -> None:
        self.waited.set()
        self.released.wait(timeout=10)
        if self.error is not None:
            raise self.error


def wait_on_a_loop_that_closes(bridge: EventBridge, event: HeldEvent) -> None:
    """Start a wait for ``event`` on a loop of its own, then close that loop under it."""
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda _loop, _context: None)  # "task destroyed pending"
    try:
        task = loop.create_task(bridge.wait(event, timeout=5))
        for _ in range(3):  # the task runs up to its wait: the event is queued
            loop.run_until_complete(asyncio.sleep(0))
        assert not task.done()
    finally:
        loop.close()


async def test_the_bridge_thread_survives_a_closed_loop() -> None:
    bridge = EventBridge("test")
    try:
        orphan = HeldEvent()
        await anyio.to_thread.run_sync(wait_on_a_loop_that_closes, bridge, orphan)
        with anyio.fail_after(5):
            await anyio.to_thread.run_sync(orphan.waited.wait, 5)
        orphan.released.set()  # its loop is gone: the thread cannot wake anyone
        # The thread goes on: the next waiters, on this loop, get their answers in time.
        failing = HeldEvent(RuntimeError("device fault"))
        failing.released.set()
        with anyio.fail_after(2), pytest.raises(RuntimeError, match="device fault"):
            await bridge.wait(failing, timeout=1)
        done = HeldEvent()
        done.released.set()
        with anyio.fail_after(2):
            await bridge.wait(done, timeout=1)
        assert bridge.alive
    finally:
        bridge.close()
    assert not bridge.alive


# The stand-in ends the thread on purpose; pytest reports the thread's exception.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_a_wait_whose_thread_stopped_ends_at_its_timeout() -> None:
    """Nothing can end a wait once the waiter thread is gone: it raises at its timeout
    instead of hanging (a BaseException from the device call ends the thread)."""
    bridge = EventBridge("test")
    try:
        fatal = HeldEvent(SystemExit())  # ends a thread without a traceback
        fatal.released.set()
        with anyio.fail_after(2), pytest.raises(TimeoutError, match="nothing is left"):
            await bridge.wait(fatal, timeout=0.05)
        assert not bridge.alive
        # Later waits on the stopped bridge end the same way.
        with anyio.fail_after(2), pytest.raises(TimeoutError):
            await bridge.wait(HeldEvent(), timeout=0.05)
    finally:
        bridge.close()


async def test_close_serves_the_events_queued_before_it() -> None:
    bridge = EventBridge("test")
    held = HeldEvent()
    outcome: list[str] = []

    async def waiter() -> None:
        await bridge.wait(held, timeout=5)
        outcome.append("done")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.to_thread.run_sync(held.waited.wait, 5)
            closing = threading.Thread(target=bridge.close)
            closing.start()
            held.released.set()
            await anyio.to_thread.run_sync(closing.join, 5)
    assert outcome == ["done"]
    assert not bridge.alive


async def test_wait_out_respects_its_timeout() -> None:
    loop = asyncio.get_running_loop()
    pending: asyncio.Future[None] = loop.create_future()
    with anyio.fail_after(2):
        with pytest.raises(TimeoutError):
            await wait_out((pending,), timeout=0.05)
        # Told that something will still end the future, it waits past the timeout, and
        # gives up once told otherwise.
        asked: list[bool] = []

        def still_running() -> bool:
            asked.append(len(asked) < 2)
            return asked[-1]

        with pytest.raises(TimeoutError):
            await wait_out((pending,), timeout=0.02, still_running=still_running)
        assert asked == [True, True, False]
    assert not pending.done()  # left alone

    # A future that ends only after the timeout has passed (what ends it is asked then):
    # the wait goes on to its end and says it was overdue.
    late: asyncio.Future[None] = loop.create_future()

    def ends_late() -> bool:
        loop.call_soon(late.set_result, None)
        return True

    with anyio.fail_after(2):
        assert await wait_out((late,), timeout=0.02, still_running=ends_late)
    done: asyncio.Future[Any] = loop.create_future()
    done.set_result(None)
    assert not await wait_out((done,), timeout=0.02)
    assert not await wait_out((), timeout=0.02)


async def test_wait_out_holds_an_asyncio_cancellation_until_the_wait_is_over() -> None:
    """``task.cancel()`` neither ends the wait nor touches the futures: the cancellation
    is raised once they are done, or once the wait gives up on them."""
    loop = asyncio.get_running_loop()
    pending: asyncio.Future[None] = loop.create_future()
    with anyio.fail_after(5):
        task = asyncio.ensure_future(wait_out((pending,), timeout=60))
        await asyncio.sleep(0)
        task.cancel()
        for _ in range(10):  # the cancellation reaches the task and is held
            await asyncio.sleep(0)
        assert not task.done() and not pending.done()
        pending.set_result(None)
        with pytest.raises(asyncio.CancelledError):
            await task

        # Nothing ends the future: the wait goes on to its timeout (where it asks whether
        # something still will), gives up, and only then raises the cancellation.
        stuck: asyncio.Future[None] = loop.create_future()
        asked: list[bool] = []

        def still_running() -> bool:
            asked.append(False)
            return False

        task = asyncio.ensure_future(wait_out((stuck,), timeout=0.05, still_running=still_running))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert asked == [False]
    assert not stuck.done()  # left alone
