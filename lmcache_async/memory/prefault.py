"""Making a pool's pages ready before they are needed: transparent huge pages asked for, and
every page faulted in by a background thread.

A fresh anonymous (or shared-memory) page costs a page fault on its first write, which makes
a just-started engine store and load at a fraction of its steady speed until the whole pool
has been written once. :func:`advise_huge_pages` asks the kernel for 2 MiB pages over the
arena (fewer faults and TLB misses), and :class:`Prefault` faults the arena in, slice by
slice, with ``MADV_POPULATE_WRITE`` (Linux 5.14+): it maps every page writable without
changing its contents, so it is safe on pages an allocation is writing at the same time.

Everything here is a no-op where the kernel lacks the advice (other systems, older Linux):
pages are then faulted in on first use, as before. Page-locked (CUDA-registered) arenas are
already resident and are left alone by the caller.
"""

from __future__ import annotations

import ctypes
import errno
import sys
import threading
from collections.abc import Callable
from typing import Final

import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.logging import get_logger

__all__ = ["DEFAULT_PREFAULT_LIMIT", "DEFAULT_PREFAULT_SLICE", "Prefault", "advise_huge_pages"]

log = get_logger(__name__)

DEFAULT_PREFAULT_SLICE: Final = 2 * 1024 * 1024
"""Bytes faulted in per call: one huge page, what :meth:`Prefault.stop` may wait for (a
millisecond or so) and what a request's first write into the same pages may wait behind.
Slices of 16 MiB made a store issued while the worker ran wait up to ~100 ms at the p90
(a kernel busy on the slice), against ~14 ms with 2 MiB."""
DEFAULT_PREFAULT_LIMIT: Final = 1024**3
"""Bytes faulted in at most, from the start of the arena (where first allocations land):
the first requests' worth; the rest of a larger pool faults in as it is used."""

_OS_PAGE: Final = 4096
_MADV_HUGEPAGE: Final = 14
_MADV_POPULATE_WRITE: Final = 23


def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` (it releases the GIL while it runs), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        func = libc.madvise
    except (OSError, AttributeError):
        return None
    func.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    func.restype = ctypes.c_int
    return func


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The OS-page-aligned start and length covering ``tensor``'s bytes."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = start - start % _OS_PAGE
    return first, -(-(end - first) // _OS_PAGE) * _OS_PAGE


def advise_huge_pages(arena: torch.Tensor) -> bool:
    """Ask for transparent huge pages over ``arena`` (``MADV_HUGEPAGE``); whether the kernel
    took the advice. Touches no page. Never raises."""
    madvise = _madvise()
    if madvise is None or arena.numel() == 0:
        return False
    start, length = _span(arena)
    return madvise(start, length, _MADV_HUGEPAGE) == 0


class Prefault:
    """A thread that faults ``arena``'s pages in, ``slice_bytes`` at a time, until it has
    covered the arena's first ``limit_bytes`` or :meth:`stop` is called.

    ``on_slice(offset)`` runs on the thread before each slice (tests hold the worker there).
    The thread holds a reference to ``arena`` until it ends, so the memory stays mapped.
    """

    def __init__(
        self,
        arena: torch.Tensor,
        *,
        slice_bytes: int = DEFAULT_PREFAULT_SLICE,
        limit_bytes: int = DEFAULT_PREFAULT_LIMIT,
        on_slice: Callable[[int], None] | None = None,
    ) -> None:
        """Raises:
        InvalidInputError: ``slice_bytes`` is not a positive multiple of 4096, or
            ``limit_bytes`` is not a positive int.
        """
        if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes <= 0:
            raise InvalidInputError(f"limit_bytes must be a positive int, got {limit_bytes!r}")
        self._limit = limit_bytes
        if isinstance(slice_bytes, bool) or not isinstance(slice_bytes, int):
            raise InvalidInputError(f"slice_bytes must be an int, got {slice_bytes!r}")
        if slice_bytes <= 0 or slice_bytes % _OS_PAGE:
            raise InvalidInputError(
                f"slice_bytes must be a positive multiple of {_OS_PAGE}, got {slice_bytes}"
            )
        self._arena: torch.Tensor | None = arena
        self._slice = slice_bytes
        self._on_slice = on_slice
        self._stopping = threading.Event()
        self._faulted = 0
        self._thread = threading.Thread(target=self._run, name="lmcache-pool-prefault", daemon=True)

    @property
    def faulted_bytes(self) -> int:
        """Bytes of the arena faulted in so far."""
        return self._faulted

    @property
    def running(self) -> bool:
        """Whether the thread has started and not yet ended."""
        return self._thread.is_alive()

    def start(self) -> None:
        """Start the thread; returns at once."""
        self._thread.start()

    def cancel(self) -> None:
        """Ask the thread to stop before its next slice; returns at once."""
        self._stopping.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the thread to end; whether it has."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """:meth:`cancel`, then wait for the slice in progress (one call of a few ms)."""
        self.cancel()
        self.join()

    def _run(self) -> None:
        arena, self._arena = self._arena, None
        madvise = _madvise()
        if arena is None or madvise is None:
            return
        start, length = _span(arena)
        length = min(length, self._limit)
        offset = 0
        while offset < length and not self._stopping.is_set():
            if self._on_slice is not None:
                self._on_slice(offset)
                if self._stopping.is_set():
                    break
            size = min(self._slice, length - offset)
            if madvise(start + offset, size, _MADV_POPULATE_WRITE) != 0:
                code = ctypes.get_errno()
                if code == errno.EINVAL:  # before Linux 5.14: pages fault in on first use
                    log.debug("pool_prefault_unsupported")
                else:
                    log.warning("pool_prefault_failed", offset=offset, errno=code)
                return
            offset += size
            self._faulted = min(offset, arena.numel())
        log.debug("pool_prefaulted", nbytes=self._faulted, stopped=self._stopping.is_set())
