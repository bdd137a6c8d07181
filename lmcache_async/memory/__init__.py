"""Host memory: the pool of pages every chunk payload lives in.

:mod:`.pool` (:class:`MemoryPool`: asynchronous allocation bounded by a timeout, eviction
through the CPU tier), :mod:`.arena` (the one mapping pages are carved from, shared memory
in sidecar mode), :mod:`.pages` (the page, fitted to the chunk: :func:`page_size_for`),
:mod:`.objects` (:class:`MemoryObj`, a view on pages with reference and pin counts),
:mod:`.shapes` (what payloads of one shape share; their views made when asked for),
:mod:`.budget` (one allocation allowance per request), :mod:`.pinning` (page-locking
host memory for CUDA copies) and :mod:`.prefault` (huge pages, and the arena faulted in
behind the start).

May import: the ground floor. Never the other data-model packages or anything above them.
"""

from __future__ import annotations

from lmcache_async.memory.pool import (
    DEFAULT_PAGE_SIZE,
    AllocationBudget,
    Evictor,
    MemoryObj,
    MemoryPool,
    PoolStats,
    current_budget,
    page_size_for,
    waited_in_vain,
)

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
