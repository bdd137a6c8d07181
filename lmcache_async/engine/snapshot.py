"""The engine's statistics snapshot, read from the parts that keep the numbers."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from lmcache_async.memory.pool import MemoryPool
from lmcache_async.tenancy.labels import TenantLabels
from lmcache_async.tenancy.tenants import TAG_BYTES, tag_hex

from ..backends.manager import StorageManager
from ..events import EventBuffer
from ..stats import (
    OTHER_TENANTS,
    Counters,
    EngineStats,
    LoadCostStats,
    TenantCounters,
    TenantStats,
    TenantTraffic,
    TenantUsage,
    TierStats,
)
from .costs import LoadCosts

__all__ = ["engine_stats", "tenant_stats"]


def engine_stats(
    counters: Counters,
    pool: MemoryPool,
    manager: StorageManager,
    events: EventBuffer,
    *,
    healthy: bool,
    labels: TenantLabels | None = None,
    costs: LoadCosts | None = None,
) -> EngineStats:
    """A snapshot of traffic, memory, tiers and switches, with the figures by tenant under
    the operator's ``labels`` (a tenant without one: its tag's hex; never its name); with
    ``costs``, the tier speeds and load decisions."""
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
        promises=counters.promises,
        promised_tokens=counters.promised_tokens,
        promises_cut_short=counters.promises_cut_short,
        promise_shortfall_tokens=counters.promise_shortfall_tokens,
        load_costs=LoadCostStats() if costs is None else costs.stats(),
        admission=manager.admission_stats(),
        tenants=MappingProxyType(
            tenant_stats(counters.tenants, tiers, labels or TenantLabels.parse({}))
        ),
    )


def tenant_stats(
    traffic: TenantCounters, tiers: Mapping[str, TierStats], labels: TenantLabels
) -> dict[str, TenantStats]:
    """Each tenant's lookups (``traffic``) and usage of each tier (``TierStats.tenants``,
    by tag), by the label ``labels`` gives its tag (else the tag's hex), in label order."""
    lookups: dict[str, TenantTraffic] = {
        tag_hex(tag) if tag else "": counts for tag, counts in traffic.items()
    }
    usage: dict[str, dict[str, TenantUsage]] = {}
    for tier_name, tier in tiers.items():
        for tag, tier_usage in tier.tenants.items():
            usage.setdefault(tag, {})[tier_name] = tier_usage
    figures: dict[str, TenantStats] = {}
    for tag in sorted(lookups.keys() | usage.keys()):
        counts = lookups.get(tag) or TenantTraffic()
        held = usage.get(tag, {})
        label = _label(tag, labels)
        if label in figures:  # not a tag a tier should report: kept apart all the same
            label = f"{label} [{tag}]"
        figures[label] = TenantStats(
            tag=tag,
            lookup_requests=counts.lookup_requests,
            lookup_tokens=counts.lookup_tokens,
            lookup_hit_tokens=counts.lookup_hit_tokens,
            chunks=sum(u.chunks for u in held.values()),
            bytes=sum(u.bytes for u in held.values()),
            tiers=MappingProxyType(held),
        )
    return dict(sorted(figures.items()))


def _label(tag: str, labels: TenantLabels) -> str:
    if not tag:
        return OTHER_TENANTS
    try:
        raw = bytes.fromhex(tag)
    except ValueError:
        return f"tag:{tag}"
    return labels.label(raw) if len(raw) == TAG_BYTES else f"tag:{tag}"
