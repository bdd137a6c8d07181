"""The request core: every rule about what a request stores or loads, in one place.

A store is ``reserve`` (keys decided, already-held chunks skipped, memory allocated, the
partial-store rule applied) → the caller fills the reserved buffers → ``commit`` (or
``abort``); a load is ``reserve`` (the held prefix referenced, lower tiers read and
verified) → the caller copies out → ``release``. The embedded pipelines run these phases
as stages; the sidecar runs them for its clients, which copy the KV themselves with the
same copy path (:mod:`.copy`).

May import: ``backends``, the data model and the ground floor. Never ``pipelines``,
``engine``, ``rpc`` or anything above.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmcache_async.memory.pool import MemoryObj, MemoryPool

from .load import LoadCore, Prefetch
from .store import Cancellable, StoreCore, StoreTxn

__all__ = ["Cancellable", "LoadCore", "Prefetch", "RequestCore", "StoreCore", "StoreTxn"]


@dataclass(frozen=True, slots=True)
class RequestCore:
    """Both halves of the core over one engine's memory pool."""

    store: StoreCore
    load: LoadCore
    pool: MemoryPool

    def buffer_offset(self, obj: MemoryObj) -> int:
        """Byte offset of ``obj``'s payload in the pool's buffer (a shared-memory segment
        in sidecar mode, where a client copies into it directly)."""
        return self.pool.arena_offset + obj.offset
