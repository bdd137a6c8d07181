"""The figures by tenant of a STATS reply as text: what ``lmcache-async stats --by-tenant``
prints.

A sidecar's STATS reply holds the engine's stats as plain data; their ``"tenants"`` map each
tenant's label (the operator's label, else its tag's hex, or ``"(none)"``; never its name) to
its lookups, its chunks and bytes over the tiers and its usage of each tier
(:class:`~lmcache_async.stats.TenantStats`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from lmcache_async.rpc.tables import size_text, text_table

__all__ = ["format_tenants"]

_TRAFFIC_COLUMNS: Final = (
    "TENANT",
    "TAG",
    "LOOKUPS",
    "HIT TOKENS",
    "TOKENS",
    "HIT RATE",
    "CHUNKS",
    "BYTES",
)
_USAGE_COLUMNS: Final = ("TENANT", "TIER", "CHUNKS", "BYTES", "QUOTA", "EVICTED", "ERASED")


def _int(mapping: Mapping[str, Any], key: str) -> int:
    value = mapping.get(key, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def format_tenants(reply: Mapping[str, Any]) -> str:
    """The tenants of the STATS reply ``reply``: a table of each tenant's lookups and what
    the tiers hold of it, then one of each tenant's usage of each tier (held, quota,
    evicted, erased)."""
    stats = reply.get("stats")
    if not stats:
        return "tenants     none: the engine is not open (no client has said hello yet)"
    tenants: Mapping[str, Any] = stats.get("tenants") or {}
    if not tenants:
        return "tenants     none yet (no lookup, nothing held)"
    traffic_rows = []
    usage_rows = []
    for label, figures in tenants.items():
        asked = _int(figures, "lookup_tokens")
        hits = _int(figures, "lookup_hit_tokens")
        traffic_rows.append(
            [
                label,
                figures.get("tag") or "-",
                _int(figures, "lookup_requests"),
                hits,
                asked,
                f"{100 * hits / asked:.1f}%" if asked else "-",
                _int(figures, "chunks"),
                size_text(_int(figures, "bytes")),
            ]
        )
        for tier, usage in (figures.get("tiers") or {}).items():
            quota = usage.get("quota_bytes")
            usage_rows.append(
                [
                    label,
                    tier,
                    _int(usage, "chunks"),
                    size_text(_int(usage, "bytes")),
                    "-" if not isinstance(quota, int) else size_text(quota),
                    _int(usage, "evictions"),
                    _int(usage, "erased"),
                ]
            )
    lines = [f"tenants     {len(tenants)}", text_table(_TRAFFIC_COLUMNS, traffic_rows)]
    if usage_rows:
        lines += ["tenant usage by tier", text_table(_USAGE_COLUMNS, usage_rows)]
    return "\n".join(lines)
