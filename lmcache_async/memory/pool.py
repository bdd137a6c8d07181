"""Host memory: one arena carved into pages, handed out as typed tensor views.

A :class:`MemoryPool` owns a single ``torch.uint8`` tensor (the *arena*), allocated once and,
when CUDA is present, page-locked (exactly its bytes, registered with CUDA) so host<->device
copies can run asynchronously; :attr:`MemoryPool.pinned` says whether it is. The arena is cut
into fixed-size pages (:mod:`lmcache_async.memory.pages` fits the page to the chunk); every
allocation is a run of whole, contiguous pages, so each chunk payload is one tensor view
(``arena[off:off + nbytes].view(dtype).view(shape)``, made when asked for:
:mod:`lmcache_async.memory.shapes`) that can be copied in a single transfer.

Allocation is asynchronous: :meth:`MemoryPool.allocate` waits, bounded by a timeout, until
pages are returned by :meth:`MemoryObj.unref` or released by the *evictor* (the CPU tier's
hook that evicts unpinned, unreferenced entries). Waiters are served strictly in FIFO order,
so a large request is never starved by a stream of small ones. Inside an
:class:`~lmcache_async.memory.budget.AllocationBudget`'s scope the waits of one request
share one allowance, and a batch that has taken memory does not wait for more
(:mod:`lmcache_async.memory.budget`).

Threading: a pool and its objects belong to one event-loop thread. ``allocate*``,
``ref``/``unref``, ``pin``/``unpin`` and ``close`` must be called from that thread (a worker
thread may read and write an object's :attr:`MemoryObj.tensor` while the owner holds a
reference). The evictor is called synchronously on that thread and must not allocate.

:class:`MemoryObj` lives in :mod:`lmcache_async.memory.objects` (re-exported here), and the
arena is allocated, or carved from a buffer, by :mod:`lmcache_async.memory.arena` (and
page-locked by :mod:`lmcache_async.memory.pinning`); :meth:`MemoryPool.prefault` faults a
pageable arena in on a thread of :mod:`lmcache_async.memory.prefault`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

import anyio
import anyio.lowlevel
import torch

from lmcache_async.errors import AllocationTimeoutError, EngineClosedError, InvalidInputError
from lmcache_async.logging import get_logger
from lmcache_async.memory.arena import Buffer, alignment_skip, buffer_tensor, host_arena
from lmcache_async.memory.budget import AllocationBudget, current_budget, waited_in_vain
from lmcache_async.memory.free_runs import FreeRuns
from lmcache_async.memory.objects import MemoryObj
from lmcache_async.memory.pages import DEFAULT_PAGE_SIZE, PAGE_ALIGNMENT, page_size_for
from lmcache_async.memory.prefault import (
    DEFAULT_PREFAULT_LIMIT,
    DEFAULT_PREFAULT_SLICE,
    Prefault,
)
from lmcache_async.memory.shapes import PayloadShape, PayloadShapes
from lmcache_async.stats import PoolStats

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "AllocationBudget",
    "Evictor",
    "MemoryObj",
    "MemoryPool",
    "PoolStats",
    "current_budget",
    "page_size_for",
    "waited_in_vain",
]

log = get_logger(__name__)

Evictor = Callable[[int], int]
"""Hook ``evictor(nbytes) -> released``: asked for ``nbytes`` more contiguous room, it evicts
entries (their :meth:`MemoryObj.unref` returns pages to the pool) and returns how many bytes
it released. The pool checks what was actually freed rather than trusting the return value."""


class _Waiter:
    """One :meth:`MemoryPool.allocate` call queued for space."""

    __slots__ = ("event", "npages")

    def __init__(self, npages: int) -> None:
        self.npages = npages
        self.event = anyio.Event()


class MemoryPool:
    """A host arena of fixed-size pages from which :class:`MemoryObj` payloads are carved.

    Allocations are whole runs of contiguous pages, chosen first-fit over a free list sorted
    by page index; freed runs coalesce with their neighbours. Zero-size shapes are rejected
    (an empty payload is a caller bug, and it would need no pages to alias).

    Not thread-safe: use a pool and its objects from one event-loop thread (see module doc).
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        page_size: int = DEFAULT_PAGE_SIZE,
        pin_memory: bool | None = None,
        evictor: Evictor | None = None,
        buffer: Buffer | None = None,
    ) -> None:
        """Allocate the arena (``torch.empty``: pages are not touched until used, unless
        the arena is pinned).

        Args:
            capacity_bytes: arena size; rounded down to whole pages, at least one page.
            page_size: bytes per page, a positive multiple of 256 (:func:`page_size_for`
                fits one to the chunks the pool holds).
            pin_memory: pin the arena, registering exactly :attr:`capacity_bytes` with CUDA
                (:attr:`pinned`, ``stats().pinned_bytes``); ``None`` pins it when CUDA is
                available (and never when ``buffer`` is given). When CUDA cannot pin it the
                pool works unpinned, with a warning logged.
            evictor: the hook asked to free room when an allocation does not fit.
            buffer: a writable buffer to carve the arena from instead of allocating one
                (e.g. a ``multiprocessing.shared_memory.SharedMemory``'s ``buf``); the arena
                starts at :attr:`arena_offset` in it. The caller keeps it alive and mapped
                while the pool or any of its objects is in use.

        Raises:
            InvalidInputError: a size is not positive, ``page_size`` is not a multiple of
                256, pinned memory was asked for without CUDA (or together with
                ``buffer``), the host memory cannot be allocated, or ``buffer`` is read-only
                or smaller than ``capacity_bytes`` plus its alignment.
        """
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise InvalidInputError(f"capacity_bytes must be an int, got {capacity_bytes!r}")
        if isinstance(page_size, bool) or not isinstance(page_size, int):
            raise InvalidInputError(f"page_size must be an int, got {page_size!r}")
        if capacity_bytes <= 0:
            raise InvalidInputError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if page_size <= 0 or page_size % PAGE_ALIGNMENT != 0:
            raise InvalidInputError(
                f"page_size must be a positive multiple of {PAGE_ALIGNMENT}, got {page_size}"
            )
        num_pages = max(1, capacity_bytes // page_size)
        arena = host_arena(num_pages * page_size, pin_memory, buffer)
        # Unregistered exactly once: by close(), or when the pool is collected unclosed.
        self._registration = arena.registration
        if arena.registration is not None:
            arena.registration.release_when_collected(self)
        self._arena = arena.tensor
        self._arena_offset = arena.offset
        self._page_size = page_size
        self._num_pages = num_pages
        self._evictor = evictor
        self._evicting = False
        self._closed = False
        # Free runs of pages, sorted by start page; never adjacent (they are coalesced).
        self._free = FreeRuns(num_pages)
        self._num_objects = 0
        self._pinned = 0
        self._waiters: deque[_Waiter] = deque()
        self._shapes = PayloadShapes(self._arena, page_size, num_pages)
        self._prefault: Prefault | None = None
        log.debug(
            "memory_pool_created",
            capacity_bytes=num_pages * page_size,
            page_size=page_size,
            pinned_bytes=self.pinned_bytes,
        )

    @classmethod
    def from_buffer(
        cls,
        buffer: Buffer,
        *,
        page_size: int = DEFAULT_PAGE_SIZE,
        evictor: Evictor | None = None,
    ) -> MemoryPool:
        """A pool whose arena is as many whole pages as fit in ``buffer`` (never pinned).

        Raises:
            InvalidInputError: ``buffer`` is not a writable bytes-like object or holds less
                than one page after alignment, or ``page_size`` is invalid.
        """
        try:
            view = memoryview(buffer)
        except TypeError:
            raise InvalidInputError(
                f"buffer must be a bytes-like object, got {type(buffer).__name__}"
            ) from None
        # The arena starts on an alignment boundary inside the buffer.
        usable = view.nbytes - alignment_skip(buffer_tensor(view))
        if isinstance(page_size, int) and page_size > 0 and usable < page_size:
            raise InvalidInputError(
                f"buffer of {view.nbytes} bytes holds less than one page of {page_size}"
            )
        return cls(usable, page_size=page_size, evictor=evictor, buffer=view)

    @property
    def capacity_bytes(self) -> int:
        """Arena size in bytes (a whole number of pages)."""
        return self._num_pages * self._page_size

    @property
    def arena_offset(self) -> int:
        """Where the arena starts in the allocation or buffer it was carved from (bytes)."""
        return self._arena_offset

    @property
    def page_size(self) -> int:
        """Bytes per page."""
        return self._page_size

    @property
    def pinned(self) -> bool:
        """Whether the arena is page-locked host memory now (registered with CUDA, not yet
        unregistered by :meth:`close`): only then may copies to or from its objects be
        ``non_blocking`` without turning synchronous."""
        return self.pinned_bytes > 0

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the arena page-locked for CUDA: :attr:`capacity_bytes` exactly while
        :attr:`pinned`, else 0."""
        return 0 if self._registration is None else self._registration.locked_bytes

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def prefault(
        self,
        *,
        slice_bytes: int = DEFAULT_PREFAULT_SLICE,
        limit_bytes: int = DEFAULT_PREFAULT_LIMIT,
        on_slice: Callable[[int], None] | None = None,
    ) -> Prefault | None:
        """Fault the arena's first ``limit_bytes`` in on a thread (returns at once), so
        first writes run at the speed of later ones; :meth:`close` stops and joins it.
        Safe while objects are written (:mod:`.prefault`). Returns the worker, or None:
        the arena is page-locked (resident), the pool closed, or a worker started before.

        Raises:
            InvalidInputError: a bad ``slice_bytes`` or ``limit_bytes`` (:class:`Prefault`).
        """
        if self.pinned or self._closed or self._prefault is not None:
            return None
        worker = Prefault(
            self._arena, slice_bytes=slice_bytes, limit_bytes=limit_bytes, on_slice=on_slice
        )
        self._prefault = worker
        worker.start()
        return worker

    @property
    def prefaulting(self) -> Prefault | None:
        """The worker :meth:`prefault` started (running or done), or None."""
        return self._prefault

    def set_evictor(self, evictor: Evictor | None) -> None:
        """Install (or remove, with ``None``) the hook asked to free room when needed."""
        self._evictor = evictor

    def pages_for(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """How many pages a ``shape``/``dtype`` payload takes.

        Raises:
            InvalidInputError: bad shape or dtype, or a request larger than the capacity.
        """
        return self._check_request(shape, dtype).npages

    def make_room(self, npages: int) -> None:
        """Ask the evictor once for whatever ``npages`` more pages need beyond those free:
        a store about to allocate k payloads evicts for all of them in one pass over the
        LRU, not once per payload. Nothing happens while :meth:`allocate` calls wait (they
        are served first) or while the evictor runs."""
        shortfall = npages - self._free.free
        if shortfall <= 0 or self._evictor is None or self._evicting or self._waiters:
            return
        self._evicting = True
        try:
            self._evictor(shortfall * self._page_size)
        finally:
            self._evicting = False

    def allocate_nowait(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        """Allocate a ``shape``/``dtype`` payload now, asking the evictor if it does not fit.

        Returns ``None`` when there is still no room, or when :meth:`allocate` calls are
        already waiting (they are served first). Never waits.

        Raises:
            InvalidInputError: bad shape or dtype, or a request larger than the capacity.
            EngineClosedError: the pool is closed.
        """
        request = self._check_request(shape, dtype)
        if self._waiters:
            return None
        page = self._take(request.npages)
        if page is None:
            return None
        budget = current_budget()
        if budget is not None:
            budget.took(0.0)
        return self._make_obj(page, request)

    async def allocate(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        timeout: float,
    ) -> MemoryObj:
        """Allocate a ``shape``/``dtype`` payload, waiting up to ``timeout`` seconds for room.

        Waiting callers queue in FIFO order; only the head of the queue is retried (asking
        the evictor again) each time pages are freed, a reference is dropped or a pin is
        released. Cancelling a waiting call removes it from the queue and leaks nothing.
        Inside an :class:`~lmcache_async.memory.budget.AllocationBudget`'s scope the wait
        is at most what the budget allows now (possibly none: then the payload is had at
        once or not at all).

        Raises:
            InvalidInputError: bad shape, dtype or timeout, or a request larger than the
                whole capacity (it could never be served).
            AllocationTimeoutError: no room within ``timeout`` seconds.
            EngineClosedError: the pool is closed, before or while waiting.
        """
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise InvalidInputError(f"timeout must be a number, got {timeout!r}")
        if math.isnan(timeout) or timeout < 0:
            raise InvalidInputError(f"timeout must be >= 0, got {timeout}")
        request = self._check_request(shape, dtype)
        npages = request.npages
        await anyio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        budget = current_budget()
        if budget is not None:
            timeout = budget.allowed_wait(timeout)
        if not self._waiters:
            page = self._take(npages)
            if page is not None:
                if budget is not None:
                    budget.took(0.0)
                return self._make_obj(page, request)
        waited = 0.0
        if timeout > 0:
            began = anyio.current_time()
            obj = await self._wait(request, timeout)
            waited = anyio.current_time() - began
            if obj is not None:
                if budget is not None:
                    budget.took(waited)
                return obj
        if budget is not None:
            budget.missed(waited)
        log.debug(
            "allocation_timeout",
            nbytes=request.nbytes,
            timeout=timeout,
            free_bytes=self._free.free * self._page_size,
            waiters=len(self._waiters),
        )
        raise AllocationTimeoutError(
            f"no room for {request.nbytes} bytes ({npages} pages) within {timeout:.3g} s"
        )

    async def _wait(self, request: PayloadShape, timeout: float) -> MemoryObj | None:
        """Queue for room, FIFO, for at most ``timeout`` seconds; None when none came."""
        waiter = _Waiter(request.npages)
        self._waiters.append(waiter)
        try:
            with anyio.move_on_after(timeout):
                while True:
                    await waiter.event.wait()
                    self._check_open()
                    if self._waiters[0] is not waiter:
                        waiter.event = anyio.Event()
                        continue
                    page = self._take(request.npages)
                    if page is not None:
                        return self._make_obj(page, request)
                    # Nothing can change between the failed attempt and the wait below (no
                    # await in between), so replacing the event here loses no wake-up.
                    waiter.event = anyio.Event()
        finally:
            was_head = bool(self._waiters) and self._waiters[0] is waiter
            self._waiters.remove(waiter)
            if was_head:
                self._wake_head()
        return None

    def stats(self) -> PoolStats:
        """Return a snapshot of occupancy (O(number of free runs))."""
        capacity = self.capacity_bytes
        free = self._free.free * self._page_size
        return PoolStats(
            capacity_bytes=capacity,
            used_bytes=capacity - free,
            free_bytes=free,
            num_objects=self._num_objects,
            pinned_objects=self._pinned,
            waiters=len(self._waiters),
            largest_free_bytes=self._free.largest() * self._page_size,
            pinned_bytes=self.pinned_bytes,
        )

    def close(self, *, unpin: bool = True) -> None:
        """Refuse new allocations, wake every waiter (they raise EngineClosedError) and,
        unless ``unpin`` is False, :meth:`unpin`. Idempotent. Live objects stay valid (in
        pageable memory once unpinned): every copy to or from the arena must be done. A
        :meth:`prefault` worker is stopped and joined (it finishes the slice it is on)."""
        if not self._closed:
            self._closed = True
            for waiter in self._waiters:
                waiter.event.set()
            log.debug("memory_pool_closed", live_objects=self._num_objects)
        if self._prefault is not None:
            self._prefault.stop()
        if unpin:
            self.unpin()

    def unpin(self) -> None:
        """Unregister the arena from CUDA, once (it blocks: async callers use a thread)."""
        if self._registration is not None:
            self._registration.release()

    # -- internals ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("memory pool is closed")

    def _check_request(self, shape: Sequence[int], dtype: torch.dtype) -> PayloadShape:
        """Validate a request; return its dims, strides, exact byte size and page count."""
        self._check_open()
        return self._shapes.check(shape, dtype)

    def _make_obj(self, page: int, form: PayloadShape) -> MemoryObj:
        self._num_objects += 1
        return MemoryObj(self, page=page, form=form)

    def _take(self, npages: int) -> int | None:
        """Carve ``npages`` contiguous pages, asking the evictor while it frees something."""
        page = self._free.carve(npages)
        if page is not None or self._evictor is None or self._evicting:
            return page
        self._evicting = True
        try:
            while True:
                shortfall = (npages - self._free.largest()) * self._page_size
                before = self._free.free
                self._evictor(shortfall)
                page = self._free.carve(npages)
                if page is not None or self._free.free <= before:
                    return page
        finally:
            self._evicting = False

    def _release(self, obj: MemoryObj) -> None:
        """Called by :meth:`MemoryObj.unref` when the last reference is dropped."""
        self._free.give_back(obj._page, obj.npages)
        self._num_objects -= 1
        if obj._pin > 0:
            self._pinned -= 1
        self._wake_head()

    def _wake_head(self) -> None:
        """Let the first waiter retry: room may have appeared, or become evictable."""
        if self._waiters:
            self._waiters[0].event.set()
