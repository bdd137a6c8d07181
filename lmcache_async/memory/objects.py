"""A payload in a memory pool: a run of the pool's pages, seen as a typed tensor, with a
reference count (which frees the pages) and a pin count (which keeps the CPU tier from
evicting it).

:class:`MemoryObj` is made and freed by :class:`~lmcache_async.memory.pool.MemoryPool` and is
re-exported by :mod:`lmcache_async.memory.pool`; the threading rules there apply. It keeps
its first page and the :class:`~lmcache_async.memory.shapes.PayloadShape` it shares with
every payload of its shape; its tensor is made when asked for (:mod:`.shapes` says why).
"""

from __future__ import annotations

from typing import Protocol

import torch

from lmcache_async.errors import EngineClosedError, InvalidInputError
from lmcache_async.memory.shapes import PayloadShape

__all__ = ["MemoryObj", "PagePool"]


class PagePool(Protocol):
    """What a :class:`MemoryObj` asks of the pool its pages came from
    (:class:`~lmcache_async.memory.pool.MemoryPool`): the bookkeeping its reference and pin
    counts drive."""

    _pinned: int
    """Objects of the pool that are pinned and not freed."""

    def _release(self, obj: MemoryObj) -> None:
        """Take back the pages of ``obj``, whose last reference was dropped."""

    def _wake_head(self) -> None:
        """Let the first waiter for room retry."""


class MemoryObj:
    """A typed tensor view on contiguous pages of a pool's arena.

    Carries a reference count and a pin count. Created only by
    :class:`~lmcache_async.memory.pool.MemoryPool`, with ``ref_count == 1`` owned by the caller.
    When the reference count drops to zero the pages return to the pool and the object is
    *freed*: its tensor must no longer be used. Pins do not keep memory alive (references
    do); they tell the CPU tier not to evict the object.
    """

    __slots__ = ("_form", "_page", "_pin", "_pool", "_ref", "checksum")

    def __init__(self, pool: PagePool, *, page: int, form: PayloadShape) -> None:
        self._pool = pool
        self._page = page
        self._form = form
        self._ref = 1
        self._pin = 0
        # Checksum of the payload bytes, set by the first slow tier that writes it (the
        # payload is immutable once cached, so every tier reuses it).
        self.checksum: int | None = None

    @property
    def tensor(self) -> torch.Tensor:
        """The payload view, of :attr:`shape` and :attr:`dtype`, in the pool's arena (a new
        view each time: keep it while it is used, not longer than a reference).

        Raises:
            EngineClosedError: the object was freed (its pages may belong to another object).
        """
        if self._ref == 0:
            raise EngineClosedError("MemoryObj already freed")
        return self._form.view(self._page)

    @property
    def data(self) -> memoryview:
        """The payload's bytes, writable, in the pool's arena: what :attr:`tensor` views,
        without making a tensor (for I/O that wants bytes alone: a socket's receive, a
        checksum). The same rules as :attr:`tensor`.

        Raises:
            EngineClosedError: the object was freed.
        """
        if self._ref == 0:
            raise EngineClosedError("MemoryObj already freed")
        return self._form.bytes_at(self._page)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape the object was allocated with."""
        return self._form.dims

    @property
    def dtype(self) -> torch.dtype:
        """Element type the object was allocated with."""
        return self._form.dtype

    @property
    def nbytes(self) -> int:
        """Exact payload size in bytes (not rounded to pages)."""
        return self._form.nbytes

    @property
    def npages(self) -> int:
        """Pages the payload takes."""
        return self._form.npages

    @property
    def offset(self) -> int:
        """Byte offset of the payload from the start of the pool's arena (page-aligned).

        With :attr:`MemoryPool.arena_offset <lmcache_async.memory.pool.MemoryPool.arena_offset>`
        it locates the payload in the buffer the pool was built on, so another process
        mapping that buffer sees the same bytes.
        """
        return self._page * self._form.page_size

    @property
    def ref_count(self) -> int:
        """Current number of references; 0 once freed."""
        return self._ref

    @property
    def pin_count(self) -> int:
        """Current number of pins."""
        return self._pin

    @property
    def freed(self) -> bool:
        """Whether the pages have been returned to the pool."""
        return self._ref == 0

    def ref(self) -> MemoryObj:
        """Add a reference and return ``self``.

        Raises:
            EngineClosedError: the object was already freed.
        """
        if self._ref == 0:
            raise EngineClosedError("cannot ref a freed MemoryObj")
        self._ref += 1
        return self

    def unref(self) -> None:
        """Drop a reference; at zero the pages return to the pool and waiters are woken.

        Raises:
            EngineClosedError: the object was already freed (reference count already 0).
        """
        if self._ref == 0:
            raise EngineClosedError("unref of a freed MemoryObj")
        self._ref -= 1
        if self._ref == 0:
            self._pool._release(self)
        else:
            # The owner that remains may be the CPU tier alone: the entry may now be evictable.
            self._pool._wake_head()

    def pin(self) -> None:
        """Add a pin (the CPU tier never evicts a pinned object).

        Raises:
            EngineClosedError: the object was already freed.
        """
        if self._ref == 0:
            raise EngineClosedError("cannot pin a freed MemoryObj")
        self._pin += 1
        if self._pin == 1:
            self._pool._pinned += 1

    def unpin(self) -> None:
        """Remove a pin. Allowed after the object was freed, to balance an earlier pin.

        Raises:
            InvalidInputError: the pin count is already 0.
        """
        if self._pin == 0:
            raise InvalidInputError("unpin of a MemoryObj that is not pinned")
        self._pin -= 1
        if self._pin == 0 and self._ref > 0:
            self._pool._pinned -= 1
            self._pool._wake_head()

    def __repr__(self) -> str:
        form = self._form
        return (
            f"MemoryObj(shape={form.dims}, dtype={form.dtype}, nbytes={form.nbytes}, "
            f"page={self._page}, npages={form.npages}, ref_count={self._ref}, "
            f"pin_count={self._pin})"
        )
