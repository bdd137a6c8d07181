"""Statistics: mutable counters inside, frozen snapshots (engine, pool, tier) outside."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

__all__ = [
    "OTHER_TENANTS",
    "TENANT_TRAFFIC_TAGS",
    "AdmissionStats",
    "Counters",
    "EngineStats",
    "LoadCostStats",
    "PoolStats",
    "TenantCounters",
    "TenantStats",
    "TenantTraffic",
    "TenantUsage",
    "TierSpeedStats",
    "TierStats",
]

TENANT_TRAFFIC_TAGS: Final = 4096
"""Tenants whose lookups are counted one by one; the lookups of tenants seen later are
summed under :data:`OTHER_TENANTS`."""

OTHER_TENANTS: Final = "(other)"
"""The label of the tenants summed together (past a cap on the tenants counted one by
one, here or in a metrics endpoint)."""


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
    pinned_bytes: int = 0
    """Bytes pinned for the tenant's lookups (prefetched, promised) that the tier does not
    hold; its quota counts them too (the CPU tier's)."""
    pins_refused: int = 0
    """Chunks a prefetch or promise of the tenant did not pin: its quota was full."""


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
    """Entries found unreadable, each a miss: corrupt ones (checksum, truncation, header
    mismatch, a GCM tag that does not verify) were deleted; those sealed under another key
    (or in the clear where this tier encrypts, or the reverse) were left in place."""
    errors: int = 0
    """Operations that failed against the tier (I/O or connection errors)."""
    tenants: Mapping[str, TenantUsage] = field(default_factory=lambda: MappingProxyType({}))
    """Usage by tenant tag (32 hex characters, :func:`lmcache_async.tenancy.tenants.tag_hex`),
    for the tenants the tier has seen."""


@dataclass(frozen=True, slots=True)
class TierSpeedStats:
    """How fast one slow tier's reads were lately, as the load-or-recompute model sees it.

    The model is ``seconds = latency_s + bytes / throughput_bytes_per_s`` per read call,
    fit to recent reads (a moving average; the start probe's reads among the first).
    """

    throughput_bytes_per_s: float | None = None
    """Payload bytes per second beyond the per-call latency; None until a read returned
    bytes (``inf`` when the reads' time was all latency)."""
    latency_s: float | None = None
    """Seconds each read call costs whatever its size; None before any read."""
    samples: int = 0
    """Read calls measured (the start probe's too)."""


@dataclass(frozen=True, slots=True)
class LoadCostStats:
    """The load-or-recompute decisions: each slow tier's measured speed, and what the
    decisions promised and declined.

    ``promised_tokens`` and ``declined_tokens`` are by tier: tokens of cached prefixes
    worth loading, and tokens cached but cheaper to recompute (the sum of both is the
    tokens the decisions found cached).
    """

    tiers: Mapping[str, TierSpeedStats] = field(default_factory=lambda: MappingProxyType({}))
    prefill_tokens_per_s: float | None = None
    """The serving engine's prefill speed the last decision used (None: unknown)."""
    decisions: int = 0
    cut_decisions: int = 0
    """Decisions that declined part of what was cached."""
    promised_tokens: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    declined_tokens: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class AdmissionStats:
    """Store admission to the slow tiers (``store_threshold``): a chunk goes to disk and
    Redis only once its prefix was seen ``threshold`` times."""

    threshold: int = 1
    tracked_chunks: int = 0
    """Chunks whose sightings are counted now (at most ``capacity``)."""
    capacity: int = 0
    """The most chunks counted at once (the least recently seen are forgotten)."""
    admitted_chunks: int = 0
    """Chunks a store put into the slow tiers at once."""
    held_back_chunks: int = 0
    """Chunks a store kept in the CPU tier only, seen too few times."""
    written_behind_chunks: int = 0
    """Chunks held back, then written to the slow tiers when a lookup saw them enough."""


@dataclass(slots=True)
class TenantTraffic:
    """One tenant's lookups so far (mutable: :class:`TenantCounters` adds to it)."""

    lookup_requests: int = 0
    lookup_tokens: int = 0
    lookup_hit_tokens: int = 0


class TenantCounters:
    """Lookup traffic by tenant tag (the first bytes of a request's first key).

    One dict update per request. At most ``capacity`` tags are counted one by one; the
    lookups of tags seen after that are summed under the empty tag ``b""`` (shown as
    :data:`OTHER_TENANTS`), so a stream of one-off tenants cannot grow it without bound.
    """

    __slots__ = ("_by_tag", "_capacity")

    def __init__(self, capacity: int = TENANT_TRAFFIC_TAGS) -> None:
        self._capacity = capacity
        self._by_tag: dict[bytes, TenantTraffic] = {}

    def count(self, tag: bytes, tokens: int, hit_tokens: int) -> None:
        """Count one lookup of ``tokens`` tokens with ``hit_tokens`` hits for ``tag``."""
        by_tag = self._by_tag
        traffic = by_tag.get(tag)
        if traffic is None:
            if len(by_tag) >= self._capacity:
                tag = b""
                traffic = by_tag.get(tag)
            if traffic is None:
                traffic = by_tag[tag] = TenantTraffic()
        traffic.lookup_requests += 1
        traffic.lookup_tokens += tokens
        traffic.lookup_hit_tokens += hit_tokens

    def items(self) -> list[tuple[bytes, TenantTraffic]]:
        """``(tag, traffic)`` per tag counted (``b""``: the tenants summed together)."""
        return list(self._by_tag.items())


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
    promises: int = 0
    promised_tokens: int = 0
    promises_cut_short: int = 0
    promise_shortfall_tokens: int = 0
    tenants: TenantCounters = field(default_factory=TenantCounters)
    """Lookups by tenant."""


@dataclass(frozen=True, slots=True)
class TenantStats:
    """One tenant's figures: its lookups, and what each tier holds of it.

    ``chunks`` and ``bytes`` add up the tiers (a chunk held in the CPU tier and on disk
    counts twice); ``tiers`` has each tier's :class:`TenantUsage` (held, evicted, erased,
    quota) for the tiers that report one.
    """

    tag: str
    """The tenant's tag as 32 hex characters (``""`` for the tenants summed together)."""
    lookup_requests: int = 0
    lookup_tokens: int = 0
    lookup_hit_tokens: int = 0
    chunks: int = 0
    bytes: int = 0
    tiers: Mapping[str, TenantUsage] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def hit_rate(self) -> float:
        """Prefix hit tokens over tokens looked up (0.0 before any lookup)."""
        return self.lookup_hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    @property
    def evictions(self) -> int:
        """Chunks of the tenant evicted, over every tier."""
        return sum(usage.evictions for usage in self.tiers.values())

    @property
    def erased(self) -> int:
        """Chunks of the tenant removed by erasure, over every tier."""
        return sum(usage.erased for usage in self.tiers.values())

    @property
    def pins_refused(self) -> int:
        """Chunks the tenant's prefetches and promises did not pin: its quota was full."""
        return sum(usage.pins_refused for usage in self.tiers.values())


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
    promises: int = 0
    """Promises given (:meth:`CacheEngine.promise`: their final answers)."""
    promised_tokens: int = 0
    """Prompt tokens those promises counted, verified in host memory."""
    promises_cut_short: int = 0
    """Promises whose prefetch the scheduler stopped (``finish``) before it was done."""
    promise_shortfall_tokens: int = 0
    """Tokens the cost model chose to load that did not arrive verified (corrupt, gone,
    no memory, cut short): the serving engine recomputes them."""
    load_costs: LoadCostStats = field(default_factory=LoadCostStats)
    """The load-or-recompute model: tier speeds and its decisions."""
    admission: AdmissionStats = field(default_factory=AdmissionStats)
    """Store admission to the slow tiers (``store_threshold``)."""
    tenants: Mapping[str, TenantStats] = field(default_factory=lambda: MappingProxyType({}))
    """Figures by tenant label: the operator's label of the tenant (config
    ``tenant_labels``), else its tag's 32 hex characters, never its name; ``"(none)"`` for
    the unnamed tenant, :data:`OTHER_TENANTS` for lookups past the cap."""

    @property
    def hit_rate(self) -> float:
        """Prefix hit tokens over tokens looked up (0.0 before any lookup)."""
        return self.lookup_hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0
