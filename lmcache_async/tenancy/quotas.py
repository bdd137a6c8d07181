"""Tenant quotas: how much of each tier one tenant may hold (config ``tenant_quotas``).

Given per tier as GB per tenant name, plus ``"*"``: the quota of every tenant not named
(the unnamed tenant included). A tier with no entry, or a tenant with neither a name nor a
default there, has no quota in that tier. Written as a mapping (YAML)::

    tenant_quotas:
      cpu: {alice: 1.5, "*": 0.5}
      disk: {alice: 20}

or as text (environment variable, ``serve --tenant-quota``): ``cpu.alice=1.5,cpu.*=0.5``
(``<tier>.<tenant>=<GB>``, comma separated; a name holding a comma needs the mapping form).
Every malformed part raises :class:`~lmcache_async.errors.ConfigError` whose field names
it, e.g. ``tenant_quotas.cpu.alice``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from lmcache_async.errors import ConfigError

__all__ = ["DEFAULT_TENANT", "QUOTA_TIERS", "TenantQuotas", "TierQuota"]

QUOTA_TIERS: Final = ("cpu", "disk", "redis")
DEFAULT_TENANT: Final = "*"
"""The entry that gives every tenant not named its quota."""

_FIELD: Final = "tenant_quotas"
_GB: Final = 1024**3
_MAX_NAME_BYTES: Final = 256


@dataclass(frozen=True, slots=True)
class TierQuota:
    """One tier's quotas in bytes: ``named`` by tenant name, ``default`` for the rest."""

    named: Mapping[str, int]
    default: int | None

    def limit(self, tenant: str | None) -> int | None:
        """The quota of ``tenant`` in bytes, or None when it has none."""
        if tenant is not None and tenant in self.named:
            return self.named[tenant]
        return self.default

    @property
    def named_total(self) -> int:
        """The sum of the named tenants' quotas, in bytes: what the tier must hold for
        every one of them to be within its quota at once."""
        return sum(self.named.values())

    @property
    def largest(self) -> int:
        """The largest quota of this tier, in bytes (0 when there is none)."""
        return max([*self.named.values(), self.default or 0])


@dataclass(frozen=True, slots=True)
class TenantQuotas:
    """Quotas of each tier (:data:`QUOTA_TIERS`); build with :meth:`parse`."""

    tiers: Mapping[str, TierQuota]

    @classmethod
    def parse(cls, value: object) -> TenantQuotas:
        """Quotas from a mapping ``{tier: {tenant: GB}}``, the text form, or a
        :class:`TenantQuotas` (returned as is).

        Raises:
            ConfigError: an unknown tier, a tenant name that is empty or too long, a quota
                that is not a positive finite number, or text that does not parse; the
                field names the part (``tenant_quotas.cpu.alice``).
        """
        if isinstance(value, TenantQuotas):
            return value
        if isinstance(value, str):
            value = _parse_text(value)
        if not isinstance(value, Mapping):
            raise ConfigError(
                _FIELD,
                f"expected a mapping of tiers to {{tenant: GB}}, got {type(value).__name__}",
            )
        tiers: dict[str, TierQuota] = {}
        for tier, entries in value.items():
            if tier not in QUOTA_TIERS:
                allowed = ", ".join(repr(t) for t in QUOTA_TIERS)
                raise ConfigError(f"{_FIELD}.{tier}", f"unknown tier; expected one of {allowed}")
            tiers[tier] = _tier_quota(tier, entries)
        return cls(MappingProxyType(tiers))

    def tier(self, name: str) -> TierQuota | None:
        """The quotas of tier ``name``, or None when it has none."""
        return self.tiers.get(name)

    def to_dict(self) -> dict[str, dict[str, float]]:
        """The mapping form, in GB; :meth:`parse` reads it back."""
        out: dict[str, dict[str, float]] = {}
        for tier, quota in self.tiers.items():
            entries = {name: size / _GB for name, size in quota.named.items()}
            if quota.default is not None:
                entries[DEFAULT_TENANT] = quota.default / _GB
            out[tier] = entries
        return out


def _tier_quota(tier: str, entries: object) -> TierQuota:
    field = f"{_FIELD}.{tier}"
    if not isinstance(entries, Mapping) or not entries:
        raise ConfigError(field, f"expected a non-empty mapping of tenant to GB, got {entries!r}")
    named: dict[str, int] = {}
    default: int | None = None
    for name, size in entries.items():
        if not isinstance(name, str) or not name or len(name.encode("utf-8")) > _MAX_NAME_BYTES:
            raise ConfigError(
                field, f"a tenant must be a name of 1 to {_MAX_NAME_BYTES} bytes, got {name!r}"
            )
        limit = _quota_bytes(f"{field}.{name}", size)
        if name == DEFAULT_TENANT:
            default = limit
        else:
            named[name] = limit
    return TierQuota(MappingProxyType(named), default)


def _quota_bytes(field: str, size: object) -> int:
    if isinstance(size, bool) or not isinstance(size, int | float):
        raise ConfigError(field, f"expected a quota in GB, got {type(size).__name__} ({size!r})")
    if not math.isfinite(size) or size <= 0:
        raise ConfigError(field, f"a quota must be a positive number of GB, got {size!r}")
    limit = int(size * _GB)
    if limit < 1:
        raise ConfigError(field, f"a quota must be at least one byte, got {size!r} GB")
    return limit


def _parse_text(text: str) -> dict[str, dict[str, Any]]:
    """``cpu.alice=1.5,cpu.*=0.5`` as ``{"cpu": {"alice": 1.5, "*": 0.5}}``."""
    out: dict[str, dict[str, Any]] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        target, sep, size = part.rpartition("=")
        tier, dot, name = target.partition(".")
        if not sep or not dot:
            raise ConfigError(_FIELD, f"expected <tier>.<tenant>=<GB>, got {part!r}")
        try:
            number = float(size)
        except ValueError:
            raise ConfigError(f"{_FIELD}.{tier}.{name}", f"expected GB, got {size!r}") from None
        entries = out.setdefault(tier.strip(), {})
        if name.strip() in entries:
            raise ConfigError(f"{_FIELD}.{tier}.{name}", "given twice")
        entries[name.strip()] = number
    if not out:
        raise ConfigError(_FIELD, f"no quota in {text!r}")
    return out
