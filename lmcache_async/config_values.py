"""The checks of single configuration values: each field's type, range or allowed words,
and the parsing of an environment variable's text by its field's type."""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from lmcache_async.errors import ConfigError
from lmcache_async.tenancy.labels import TenantLabels
from lmcache_async.tenancy.quotas import TenantQuotas

__all__ = [
    "HASH_ALGORITHMS",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "REMOTE_SCHEMES",
    "TIER_CODECS",
    "TIER_NAMES",
    "check_value",
    "describe",
    "parse_env",
]

HASH_ALGORITHMS: Final = ("blake3", "xxh3_128")
TIER_NAMES: Final = ("cpu", "disk", "redis")
TIER_CODECS: Final = ("none", "zstd", "lz4", "int8")
REMOTE_SCHEMES: Final = ("redis", "rediss", "unix", "valkey", "valkeys", "redis-cluster")
LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS: Final = ("console", "json")


# Lower bound of each numeric field: (bound, inclusive).
_LOWER_BOUNDS: Final[Mapping[str, tuple[float, bool]]] = MappingProxyType(
    {
        "chunk_size": (0, False),
        "max_local_cpu_size": (0.0, False),
        "pin_timeout": (0.0, False),
        "allocation_timeout": (0.0, False),
        "retrieve_timeout": (0.0, False),
        "store_timeout": (0.0, False),
        "pipeline_queue_size": (1, True),
        "pipeline_batch_chunks": (1, True),
        "inline_copy_bytes": (0, True),
        "inline_hash_tokens": (0, True),
        "max_kv_events": (1, True),
        "max_kv_event_bytes": (1, True),
        "max_local_disk_size": (0.0, False),
        "remote_timeout": (0.0, False),
        "remote_ttl": (0.0, False),
        "slow_tier_queue_size": (1, True),
        "store_threshold": (1, True),
        "health_check_interval": (0.0, False),
    }
)

# Allowed values of each string field; ``log_level`` is matched case-insensitively.
_CHOICES: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {
        "hash_algorithm": HASH_ALGORITHMS,
        "log_level": LOG_LEVELS,
        "log_format": LOG_FORMATS,
        "tier_codec": TIER_CODECS,
    }
)

_TRUE_WORDS: Final = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS: Final = frozenset({"0", "false", "no", "off"})


def check_value(name: str, field_type: type, value: object) -> object:
    """Return ``value`` checked and normalised for field ``name``; ConfigError otherwise."""
    if value is None and name in _OPTIONAL:
        return None
    if field_type is tuple:
        return _check_locations(name, value)
    if field_type is TenantQuotas:
        return TenantQuotas.parse(value)
    if field_type is TenantLabels:
        return TenantLabels.parse(value)
    if name == "remote_url":
        return _check_remote_url(value)
    if name == "local_disk":
        if not isinstance(value, str) or not value.removeprefix("file://"):
            raise ConfigError(name, f"expected a directory path, got {describe(value)}")
        return value
    if name == "encryption_key_file":
        if not isinstance(value, str) or not value:
            raise ConfigError(name, f"expected a file path, got {describe(value)}")
        return value
    # bool is an int subclass: refuse it explicitly wherever a number is expected.
    if field_type is bool:
        if not isinstance(value, bool):
            raise ConfigError(name, f"expected a bool, got {describe(value)}")
        return value
    if field_type is str:
        if not isinstance(value, str):
            raise ConfigError(name, f"expected a string, got {describe(value)}")
        choices = _CHOICES.get(name)
        if choices is None:
            return value
        candidate = value.upper() if name == "log_level" else value
        if candidate not in choices:
            allowed = ", ".join(repr(c) for c in choices)
            raise ConfigError(name, f"expected one of {allowed}, got {value!r}")
        return candidate
    number: int | float
    if field_type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(name, f"expected an int, got {describe(value)}")
        number = value
    else:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(name, f"expected a number, got {describe(value)}")
        number = float(value)
        if not math.isfinite(number):
            raise ConfigError(name, f"must be finite, got {number!r}")
    bound = _LOWER_BOUNDS.get(name)
    if bound is not None:
        low, inclusive = bound
        ok = number >= low if inclusive else number > low
        if not ok:
            raise ConfigError(name, f"must be {'>=' if inclusive else '>'} {low}, got {number!r}")
    return number


# Fields that may be None (their annotation says ``| None``).
_OPTIONAL: Final = frozenset(
    {
        "local_disk",
        "remote_url",
        "remote_ttl",
        "store_location",
        "retrieve_locations",
        "tenant_quotas",
        "tenant_labels",
        "encryption_key_file",
        "log_level",
    }
)


def _check_locations(name: str, value: object) -> tuple[str, ...]:
    """A tuple of known tier names from a list/tuple or a comma-separated string."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list | tuple) or not value:
        raise ConfigError(name, f"expected a non-empty list of tiers, got {describe(value)}")
    for tier in value:
        if tier not in TIER_NAMES:
            allowed = ", ".join(repr(t) for t in TIER_NAMES)
            raise ConfigError(name, f"unknown tier {tier!r}; expected some of {allowed}")
    if len(set(value)) != len(value):
        raise ConfigError(name, f"a tier is named twice in {list(value)!r}")
    return tuple(value)


def _check_remote_url(value: object) -> str:
    """A Redis/Valkey URL whose scheme we speak; ConfigError(field="remote_url") otherwise."""
    if not isinstance(value, str):
        raise ConfigError("remote_url", f"expected a URL string, got {describe(value)}")
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in REMOTE_SCHEMES:
        allowed = ", ".join(f"{s}://" for s in REMOTE_SCHEMES)
        raise ConfigError("remote_url", f"unsupported URL {value!r}; expected {allowed}")
    if not rest:
        raise ConfigError("remote_url", f"URL {value!r} names no server")
    return value


def describe(value: object) -> str:
    return f"{type(value).__name__} ({value!r})"


def parse_env(name: str, field_type: type, raw: str) -> object:
    """Parse one environment value by its field's type; ConfigError naming the field."""
    text = raw.strip()
    if name in _OPTIONAL and text.lower() in ("", "none", "null"):
        return None
    if field_type in (tuple, TenantQuotas, TenantLabels):
        return text
    if field_type is bool:
        word = text.lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
        raise ConfigError(name, f"expected a bool (1/0/true/false/yes/no/on/off), got {raw!r}")
    if field_type is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(name, f"expected an int, got {raw!r}") from None
    if field_type is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(name, f"expected a number, got {raw!r}") from None
    return text
