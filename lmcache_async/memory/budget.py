"""How long one request may wait for host memory, over every allocation it makes.

A request that reads a long prefix from disk or Redis, or stores one, allocates a payload
per chunk. Were each allocation to wait its own ``allocation_timeout``, one request's waits
would add up (a chunk from disk, the next from Redis, the next batch...), and a request
that holds memory while it waits for more keeps the others waiting on it: under pressure
every request ends up holding part of the pool and waiting for the rest, until each times
out.

An :class:`AllocationBudget` is one request's allowance. While a task runs inside
:meth:`AllocationBudget.scope` (one batch of the request: a tier reading into the pool, a
store reserving its payloads), every :meth:`~lmcache_async.memory.pool.MemoryPool.allocate` it
makes, whoever makes it, is bounded by the budget:

- the waits of the whole request add up to at most its allowance (``seconds``; None: the
  first allocation's own timeout);
- once an allocation could not be had in time (:attr:`~AllocationBudget.refused`), none
  waits again: the request's run ends there and what it has is served;
- inside a scope that has taken memory, no allocation waits: the batch takes what it can
  have now (:attr:`~AllocationBudget.cut` says it stopped short for memory), so no request
  waits for room while it holds room others may be waiting for.

The budget in force travels with the task, in a context variable, as a cancel scope does:
tiers and the request core need no extra argument. Like the pool, a budget belongs to one
event-loop thread.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar

from lmcache_async.errors import InvalidInputError

__all__ = ["AllocationBudget", "current_budget", "waited_in_vain"]

_CURRENT: ContextVar[AllocationBudget | None] = ContextVar("allocation_budget", default=None)


def current_budget() -> AllocationBudget | None:
    """The budget whose :meth:`~AllocationBudget.scope` the calling task is in (None:
    allocations wait their own timeout)."""
    return _CURRENT.get()


def waited_in_vain() -> bool:
    """Whether the allocation that just failed waited for room first (worth a warning), as
    it does outside any budget; under one, most fail at once, by the budget's rules."""
    budget = _CURRENT.get()
    return budget is None or budget.last_wait > 0


class AllocationBudget:
    """One request's allowance of waiting for pool memory (see the module docstring).

    Raises:
        InvalidInputError: ``seconds`` is not a number >= 0.
    """

    __slots__ = ("_taken", "cut", "last_wait", "refused", "seconds", "waited")

    def __init__(self, seconds: float | None = None) -> None:
        if seconds is not None and (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or math.isnan(seconds)
            or seconds < 0
        ):
            raise InvalidInputError(f"seconds must be a number >= 0, got {seconds!r}")
        self.seconds: float | None = None if seconds is None else float(seconds)
        """The most the request's waits may add up to (None until its first allocation,
        which sets it to its own timeout)."""
        self.waited = 0.0
        """Seconds the request's allocations have waited so far."""
        self.refused = False
        """An allocation got no memory within what the budget allowed: no more waits."""
        self.cut = False
        """A scope that held memory stopped at a payload it could not have without
        waiting (the batch is short for memory, not for a miss)."""
        self.last_wait = 0.0
        """Seconds the last allocation that got no memory waited (0: it was not allowed to)."""
        self._taken = 0

    @property
    def left(self) -> float | None:
        """Seconds of waiting the request has left (None: not set yet)."""
        if self.seconds is None:
            return None
        return 0.0 if self.refused else max(0.0, self.seconds - self.waited)

    @property
    def exhausted(self) -> bool:
        """Whether an allocation in the current scope would get memory only if it is free
        now: refused, or cut short (a tier skips reading what it could not keep)."""
        return self.refused or self.cut

    @contextlib.contextmanager
    def scope(self) -> Iterator[AllocationBudget]:
        """Bound every allocation of the calling task by this budget for the block: one
        batch of the request (its memory counted afresh; :attr:`cut` cleared)."""
        token = _CURRENT.set(self)
        taken, self._taken = self._taken, 0
        self.cut = False
        try:
            yield self
        finally:
            _CURRENT.reset(token)
            self._taken = taken

    # -- what the pool tells the budget ---------------------------------------------------

    def allowed_wait(self, timeout: float) -> float:
        """How long an allocation asking for ``timeout`` seconds may wait now."""
        if self.refused or self._taken:
            return 0.0
        if self.seconds is None:
            self.seconds = float(timeout)
        return max(0.0, min(timeout, self.seconds - self.waited))

    def took(self, waited: float) -> None:
        """An allocation got its memory after ``waited`` seconds (0: at once)."""
        self._taken += 1
        self.waited += waited

    def missed(self, waited: float) -> None:
        """An allocation got no memory within what it was allowed (``waited`` seconds)."""
        self.waited += waited
        self.last_wait = waited
        if self._taken:
            self.cut = True
        else:
            self.refused = True
