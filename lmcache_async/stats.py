"""Statistics: mutable counters inside, frozen snapshots (engine, pool, tier) outside."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["Counters", "EngineStats", "PoolStats", "TenantUsage", "TierStats"]


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of a :class:`MemoryPool`'s occupancy."""

    capacity_bytes: int
    used_bytes: int
    """Bytes of pages held by live objects (each object rounded up to whole pages)."""
    free_bytes: int
    """``capacity_bytes - used_bytes``."""
    num_objects: int
    """Live :class:`MemoryObj` instances."""
    pinned_objects: int
    """Live objects with ``pin_count > 0``."""
    waiters: int
    """:meth:`MemoryPool.allocate` calls currently waiting for space."""
    largest_free_bytes: int
    """Largest contiguous free run; far below ``free_bytes`` means fragmentation."""
    pinned_bytes: int = 0
    """Bytes of the arena page-locked for CUDA: exactly ``capacity_bytes`` when the arena is
    pinned (registered with CUDA, never rounded up), 0 when it is not (no CUDA, pinning
    failed, or the pool is closed)."""


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """One tenant's share of one tier."""

    chunks: int = 0
    bytes: int = 0
    """Bytes of the tenant's chunks the tier holds (what its quota counts)."""
    evictions: int = 0
    """Chunks of the tenant evicted (to keep it under its quota, or to make room)."""
    erased: int = 0
    """Chunks of the tenant removed by erasure."""
    quota_bytes: int | None = None
    """The tenant's quota in this tier, None when it has none."""


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot of one tier: contents, traffic and health."""

    name: str
    chunks: int
    bytes: int
    hits: int
    misses: int
    puts: int
    evictions: int
    healthy: bool
    corrupt: int = 0
    """Entries found corrupt (checksum, truncation, header mismatch): each was a miss and
    was deleted."""
    errors: int = 0
    """Operations that failed against the tier (I/O or connection errors)."""
    tenants: Mapping[str, TenantUsage] = field(default_factory=lambda: MappingProxyType({}))
    """Usage by tenant tag (8 hex characters, :func:`lmcache_async.tenants.tag_hex`), for
    the tenants the tier has seen."""


@dataclass(slots=True)
class Counters:
    """Running totals the engine updates as requests finish."""

    store_requests: int = 0
    retrieve_requests: int = 0
    lookup_requests: int = 0
    stored_tokens: int = 0
    retrieved_tokens: int = 0
    lookup_tokens: int = 0
    lookup_hit_tokens: int = 0
    partial_stores: int = 0
    failed_requests: int = 0
    timed_out_requests: int = 0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of an engine: traffic, pool usage, tiers and switches.

    Token counts: ``stored_tokens`` are tokens whose chunks a store found cached when it
    finished; ``retrieved_tokens`` tokens written into the serving engine's memory;
    ``lookup_hit_tokens`` / ``lookup_tokens`` the prefix hits over the tokens asked about.
    """

    pool: PoolStats
    tiers: Mapping[str, TierStats]
    store_requests: int
    retrieve_requests: int
    lookup_requests: int
    stored_tokens: int
    retrieved_tokens: int
    lookup_tokens: int
    lookup_hit_tokens: int
    partial_stores: int
    failed_requests: int
    timed_out_requests: int
    cached_chunks: int
    evicted_chunks: int
    pinned_chunks: int
    active_lookup_ids: int
    expired_pins: int
    tier_health: Mapping[str, bool]
    """Each tier's state: a slow tier that is down is bypassed until it is back."""
    tier_writes_pending: int
    """Batches queued for the slow tiers (write-behind)."""
    tier_writes_dropped: int
    """Chunks not written to a slow tier: its queue was full or it was down."""
    tier_writes_failed: int
    """Chunks a slow tier failed to write."""
    promoted_chunks: int
    """Chunks read from a slow tier and kept in the CPU tier."""
    tier_read_errors: int
    """Slow-tier reads that failed (each a miss)."""
    events_dropped: int
    healthy: bool
    frozen: bool
    hot_cache: bool

    @property
    def hit_rate(self) -> float:
        """Prefix hit tokens over tokens looked up (0.0 before any lookup)."""
        return self.lookup_hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0
