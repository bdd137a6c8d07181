"""The engine's statistics snapshot, read from the parts that keep the numbers."""

from __future__ import annotations

from ..backends.manager import StorageManager
from ..events import EventBuffer
from ..memory import MemoryPool
from ..stats import Counters, EngineStats

__all__ = ["engine_stats"]


def engine_stats(
    counters: Counters,
    pool: MemoryPool,
    manager: StorageManager,
    events: EventBuffer,
    *,
    healthy: bool,
) -> EngineStats:
    """A snapshot of traffic, memory, tiers and switches."""
    tiers = manager.tier_stats()
    cpu = tiers["cpu"]
    return EngineStats(
        pool=pool.stats(),
        tiers=tiers,
        store_requests=counters.store_requests,
        retrieve_requests=counters.retrieve_requests,
        lookup_requests=counters.lookup_requests,
        stored_tokens=counters.stored_tokens,
        retrieved_tokens=counters.retrieved_tokens,
        lookup_tokens=counters.lookup_tokens,
        lookup_hit_tokens=counters.lookup_hit_tokens,
        partial_stores=counters.partial_stores,
        failed_requests=counters.failed_requests,
        timed_out_requests=counters.timed_out_requests,
        cached_chunks=cpu.chunks,
        evicted_chunks=cpu.evictions,
        pinned_chunks=manager.pinned_chunks,
        active_lookup_ids=manager.active_lookup_ids,
        expired_pins=manager.expired_pins,
        tier_health=manager.tier_health(),
        tier_writes_pending=manager.tier_writes_pending,
        tier_writes_dropped=manager.tier_writes_dropped,
        tier_writes_failed=manager.tier_writes_failed,
        promoted_chunks=manager.promoted_chunks,
        tier_read_errors=manager.tier_read_errors,
        events_dropped=events.dropped,
        healthy=healthy,
        frozen=manager.frozen,
        hot_cache=manager.hot_cache,
    )
