"""Prometheus series by tenant, with a cap on the tenants that get a label of their own.

Each tenant of ``EngineStats.tenants`` is reported under ``tenant="<label>"``: the label the
operator gave it (config ``tenant_labels``), else its tag's 32 hex characters, never its
name (a ``cache_salt`` is a secret that a scrape must not publish). A tenant label is a
series per metric and tier, so at most ``cap`` tenants are labelled: the first ``cap`` seen
keep their label for the life of the collector (a counter never moves between series), and
every later one is summed under ``tenant="other"``.

Series (``lmcache_async_tenant_*``): ``lookups_total``, ``lookup_tokens_total``,
``lookup_hit_tokens_total`` by tenant; ``chunks``, ``bytes``, ``quota_bytes`` (tenants
with a quota), ``evictions_total``, ``erased_total``, ``pins_refused_total`` (chunks a
prefetch or promise did not pin: the tenant's quota was full) by tenant and tier.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.tokens import is_strict_int
from lmcache_async.stats import OTHER_TENANTS, EngineStats, TenantStats

__all__ = ["DEFAULT_TENANT_LABELS", "OTHER_LABEL", "TenantSeries"]

DEFAULT_TENANT_LABELS: Final = 100
"""Tenants reported under a label of their own; the rest are summed under ``other``."""

OTHER_LABEL: Final = "other"
"""The ``tenant`` label of the tenants summed together."""

_PREFIX: Final = "lmcache_async_tenant_"
_TRAFFIC: Final = (
    ("lookups", "lookup_requests", "Lookups of a tenant"),
    ("lookup_tokens", "lookup_tokens", "Tokens a tenant's lookups asked about"),
    ("lookup_hit_tokens", "lookup_hit_tokens", "Prefix tokens a tenant's lookups found"),
)
_HELD: Final = (
    ("chunks", "Chunks of a tenant a tier holds"),
    ("bytes", "Bytes of a tenant's chunks a tier holds"),
)
_COUNTED: Final = (
    ("evictions", "Chunks of a tenant a tier evicted"),
    ("erased", "Chunks of a tenant a tier removed by erasure"),
    ("pins_refused", "Chunks a tenant's prefetches and promises did not pin: quota full"),
)


class TenantSeries:
    """The tenant series of each scrape; remembers which tenants have a label.

    Raises (constructor):
        InvalidInputError: ``cap`` is not an int >= 0.
    """

    def __init__(self, cap: int = DEFAULT_TENANT_LABELS) -> None:
        if not is_strict_int(cap) or cap < 0:
            raise InvalidInputError(f"the tenant label cap must be an int >= 0, got {cap!r}")
        self._cap = cap
        self._labelled: set[str] = set()

    def _label(self, name: str) -> str:
        if name in self._labelled:
            return name
        if name not in (OTHER_TENANTS, OTHER_LABEL) and len(self._labelled) < self._cap:
            self._labelled.add(name)
            return name
        return OTHER_LABEL

    def collect(self, stats: EngineStats) -> Iterator[Metric]:
        """The families of ``stats.tenants``, tenants past the cap summed under ``other``."""
        traffic: dict[str, list[int]] = {}
        held: dict[tuple[str, str], list[int]] = {}
        quotas: dict[tuple[str, str], int] = {}
        for name, figures in stats.tenants.items():
            label = self._label(name)
            _add(traffic.setdefault(label, [0] * len(_TRAFFIC)), _traffic_of(figures))
            for tier, usage in figures.tiers.items():
                row = held.setdefault((label, tier), [0] * (len(_HELD) + len(_COUNTED)))
                _add(
                    row,
                    [usage.chunks, usage.bytes, usage.evictions, usage.erased, usage.pins_refused],
                )
                if usage.quota_bytes is not None:
                    quotas[label, tier] = quotas.get((label, tier), 0) + usage.quota_bytes
        for i, (suffix, _, doc) in enumerate(_TRAFFIC):
            counter = CounterMetricFamily(_PREFIX + suffix, doc, labels=["tenant"])
            for label, values in sorted(traffic.items()):
                counter.add_metric([label], float(values[i]))
            yield counter
        labels = ["tenant", "tier"]
        for i, (suffix, doc) in enumerate(_HELD):
            gauge = GaugeMetricFamily(_PREFIX + suffix, doc, labels=labels)
            for key, values in sorted(held.items()):
                gauge.add_metric(list(key), float(values[i]))
            yield gauge
        quota = GaugeMetricFamily(
            _PREFIX + "quota_bytes", "A tenant's quota in a tier (tenants with one)", labels=labels
        )
        for key, size in sorted(quotas.items()):
            quota.add_metric(list(key), float(size))
        yield quota
        for i, (suffix, doc) in enumerate(_COUNTED, start=len(_HELD)):
            counter = CounterMetricFamily(_PREFIX + suffix, doc, labels=labels)
            for key, values in sorted(held.items()):
                counter.add_metric(list(key), float(values[i]))
            yield counter


def _traffic_of(figures: TenantStats) -> list[int]:
    return [getattr(figures, field) for _, field, _ in _TRAFFIC]


def _add(into: list[int], values: list[int]) -> None:
    for i, value in enumerate(values):
        into[i] += value
