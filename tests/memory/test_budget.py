"""AllocationBudget: one request's waits for pool memory share one allowance, a batch that
holds memory does not wait for more, and a refusal ends the waiting for the request."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest
import torch

from lmcache_async.errors import AllocationTimeoutError, InvalidInputError
from lmcache_async.memory.pool import AllocationBudget, MemoryObj, MemoryPool, current_budget

PAGE = 1024
SHAPE = (PAGE // 4,)  # one page of float32
DTYPE = torch.float32
LONG = 60.0  # an allocation's own timeout: far longer than any test may take


def full_pool(pages: int = 4) -> tuple[MemoryPool, list[MemoryObj]]:
    pool = MemoryPool(pages * PAGE, page_size=PAGE, pin_memory=False)
    held = [pool.allocate_nowait(SHAPE, DTYPE) for _ in range(pages)]
    assert all(obj is not None for obj in held)
    return pool, [obj for obj in held if obj is not None]


def test_bad_allowance_is_refused() -> None:
    for bad in (-1.0, float("nan"), True, "1"):
        with pytest.raises(InvalidInputError, match="seconds"):
            AllocationBudget(bad)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_scope_holding_memory_does_not_wait_for_more() -> None:
    pool, held = full_pool()
    held.pop().unref()  # room for one payload
    budget = AllocationBudget(LONG)
    with anyio.fail_after(5), budget.scope():
        first = await pool.allocate(SHAPE, DTYPE, timeout=LONG)
        with pytest.raises(AllocationTimeoutError):
            await pool.allocate(SHAPE, DTYPE, timeout=LONG)  # would wait: refused at once
    assert budget.cut and not budget.refused
    assert budget.waited == 0.0 and budget.left == LONG
    assert pool.stats().waiters == 0
    # The next batch holds nothing: it may wait, and gets the room given back.
    first.unref()
    with anyio.fail_after(5), budget.scope():
        again = await pool.allocate(SHAPE, DTYPE, timeout=LONG)
    assert not budget.cut
    for obj in [again, *held]:
        obj.unref()
    assert pool.stats().num_objects == 0


@pytest.mark.anyio
async def test_waits_share_the_allowance_and_a_refusal_ends_them() -> None:
    pool, held = full_pool()
    budget = AllocationBudget(0.05)
    with anyio.fail_after(5):  # the allowance ends the wait, not the allocation's 60 s
        with budget.scope(), pytest.raises(AllocationTimeoutError):
            await pool.allocate(SHAPE, DTYPE, timeout=LONG)
        assert budget.refused and budget.left == 0.0 and budget.exhausted
        assert budget.waited >= 0.05 and budget.last_wait == budget.waited
        # Refused: a later batch waits no more, though it may take room that is free now.
        with budget.scope(), pytest.raises(AllocationTimeoutError):
            await pool.allocate(SHAPE, DTYPE, timeout=LONG)
        assert budget.last_wait == 0.0
        held.pop().unref()
        with budget.scope():
            obj = await pool.allocate(SHAPE, DTYPE, timeout=LONG)
    for item in [obj, *held]:
        item.unref()
    assert pool.stats().num_objects == 0


@pytest.mark.anyio
async def test_the_first_allocation_sets_an_unset_allowance() -> None:
    pool, held = full_pool()
    budget = AllocationBudget()
    assert budget.left is None
    with anyio.fail_after(5), budget.scope(), pytest.raises(AllocationTimeoutError):
        await pool.allocate(SHAPE, DTYPE, timeout=0.02)
    assert budget.seconds == 0.02 and budget.refused
    for obj in held:
        obj.unref()


@pytest.mark.anyio
async def test_a_nowait_allocation_counts_as_memory_held() -> None:
    pool, held = full_pool()
    held.pop().unref()
    budget = AllocationBudget(LONG)
    with anyio.fail_after(5), budget.scope():
        obj = pool.allocate_nowait(SHAPE, DTYPE)
        assert obj is not None
        with pytest.raises(AllocationTimeoutError):
            await pool.allocate(SHAPE, DTYPE, timeout=LONG)
    assert budget.cut
    for item in [obj, *held]:
        item.unref()


@pytest.mark.anyio
async def test_the_budget_follows_the_task_and_its_children_not_others() -> None:
    budget = AllocationBudget(1.0)
    seen: list[AllocationBudget | None] = []

    async def look() -> None:
        seen.append(current_budget())

    async with anyio.create_task_group() as tg:
        with budget.scope():
            assert current_budget() is budget
            tg.start_soon(look)  # started inside the scope: it inherits the budget
        tg.start_soon(look)
    assert current_budget() is None
    assert seen == [budget, None]


@pytest.mark.anyio
async def test_without_a_budget_a_waiter_gets_room_as_before() -> None:
    pool, held = full_pool()
    got: list[MemoryObj] = []

    async def wait() -> None:
        got.append(await pool.allocate(SHAPE, DTYPE, timeout=LONG))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            while pool.stats().waiters == 0:
                await anyio.lowlevel.checkpoint()
            held.pop().unref()
    for obj in [*got, *held]:
        obj.unref()
    assert len(got) == 1 and pool.stats().num_objects == 0
