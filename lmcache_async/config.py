"""Engine configuration: one frozen, validated value object.

:class:`EngineConfig` is built once, from defaults, a YAML file, ``LMCACHE_ASYNC_*``
environment variables and keyword arguments (in that order of precedence, see
:meth:`EngineConfig.load`), and checked as a whole. Every invalid value raises
:class:`~lmcache_async.errors.ConfigError` whose ``field`` names the offending key, so a
typo in a deployment fails at start with a message that says what to fix. Key names follow
LMCache's where the meaning is the same (``chunk_size``, ``local_cpu``,
``max_local_cpu_size``, ``save_unfull_chunk``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

import yaml

from lmcache_async.config_values import (
    HASH_ALGORITHMS,
    LOG_FORMATS,
    LOG_LEVELS,
    check_value,
    parse_env,
)
from lmcache_async.errors import ConfigError
from lmcache_async.tenancy.labels import TenantLabels
from lmcache_async.tenancy.quotas import TenantQuotas

__all__ = [
    "CONFIG_FILE_ENV",
    "DEFAULT_ALLOCATION_TIMEOUT",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_ENABLE_KV_EVENTS",
    "DEFAULT_HASH_ALGORITHM",
    "DEFAULT_INLINE_COPY_BYTES",
    "DEFAULT_INLINE_HASH_TOKENS",
    "DEFAULT_LOCAL_CPU",
    "DEFAULT_LOG_FORMAT",
    "DEFAULT_LOG_LEVEL",
    "DEFAULT_MAX_KV_EVENTS",
    "DEFAULT_MAX_KV_EVENT_BYTES",
    "DEFAULT_MAX_LOCAL_CPU_SIZE",
    "DEFAULT_PIN_TIMEOUT",
    "DEFAULT_PIPELINE_BATCH_CHUNKS",
    "DEFAULT_PIPELINE_QUEUE_SIZE",
    "DEFAULT_PREFAULT_POOL",
    "DEFAULT_RETRIEVE_TIMEOUT",
    "DEFAULT_SAVE_UNFULL_CHUNK",
    "DEFAULT_STORE_TIMEOUT",
    "ENV_PREFIX",
    "GB",
    "HASH_ALGORITHMS",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "EngineConfig",
]

GB: Final = 1024**3
"""Bytes in one "GB" of ``max_local_cpu_size`` (binary, as LMCache counts it)."""

ENV_PREFIX: Final = "LMCACHE_ASYNC_"
CONFIG_FILE_ENV: Final = "LMCACHE_ASYNC_CONFIG_FILE"
"""Environment variable naming a YAML file read by :meth:`EngineConfig.load`."""


DEFAULT_CHUNK_SIZE: Final = 256
DEFAULT_LOCAL_CPU: Final = True
DEFAULT_MAX_LOCAL_CPU_SIZE: Final = 5.0
DEFAULT_SAVE_UNFULL_CHUNK: Final = True
DEFAULT_PREFAULT_POOL: Final = True
DEFAULT_HASH_ALGORITHM: Final = "blake3"
DEFAULT_PIN_TIMEOUT: Final = 60.0
DEFAULT_ALLOCATION_TIMEOUT: Final = 5.0
DEFAULT_RETRIEVE_TIMEOUT: Final = 30.0
DEFAULT_STORE_TIMEOUT: Final = 60.0
DEFAULT_PIPELINE_QUEUE_SIZE: Final = 8
# Eight chunks per batch let a copy pass over each layer once for 2k tokens: measured here,
# 0.85x of one raw copy of the same bytes against 0.75x with four.
DEFAULT_PIPELINE_BATCH_CHUNKS: Final = 8
DEFAULT_INLINE_COPY_BYTES: Final = 4 * 1024 * 1024
# Hashing 64k tokens takes about as long as two thread hops; shorter prompts are hashed on
# the event loop, where the hop would cost more than it saves.
DEFAULT_INLINE_HASH_TOKENS: Final = 65536
DEFAULT_ENABLE_KV_EVENTS: Final = True
DEFAULT_MAX_KV_EVENTS: Final = 10000
DEFAULT_MAX_KV_EVENT_BYTES: Final = 64 << 20
DEFAULT_LOCAL_DISK: Final = None
DEFAULT_MAX_LOCAL_DISK_SIZE: Final = 20.0
DEFAULT_REMOTE_URL: Final = None
DEFAULT_REMOTE_TIMEOUT: Final = 2.0
DEFAULT_REMOTE_TTL: Final = None
DEFAULT_TIER_CODEC: Final = "none"
DEFAULT_STORE_LOCATION: Final = None
DEFAULT_RETRIEVE_LOCATIONS: Final = None
DEFAULT_WAIT_FOR_SLOW_TIERS: Final = False
DEFAULT_SLOW_TIER_QUEUE_SIZE: Final = 64
DEFAULT_STORE_THRESHOLD: Final = 1
DEFAULT_HEALTH_CHECK_INTERVAL: Final = 1.0
DEFAULT_REMOVE_AFTER_RETRIEVE: Final = False
DEFAULT_USE_LAYERWISE: Final = False
DEFAULT_TENANT_QUOTAS: Final = None
DEFAULT_TENANT_LABELS: Final = None
DEFAULT_ENCRYPTION_KEY_FILE: Final = None
DEFAULT_LOG_LEVEL: Final = None
DEFAULT_LOG_FORMAT: Final = "console"

# Field annotations are strings under ``from __future__ import annotations``.
_TYPES: Final[Mapping[str, type]] = MappingProxyType(
    {
        "int": int,
        "float": float,
        "bool": bool,
        "str": str,
        "str | None": str,
        "float | None": float,
        "tuple[str, ...] | None": tuple,
        "TenantQuotas | None": TenantQuotas,
        "TenantLabels | None": TenantLabels,
    }
)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Settings of one cache engine; immutable and validated on construction.

    Build it directly (``EngineConfig(chunk_size=512)``), from a mapping
    (:meth:`from_dict`), from a YAML file (:meth:`from_file`) or from every source at
    once (:meth:`load`). Change it with :meth:`replace`, which validates again.

    Raises:
        ConfigError: a value has the wrong type (a bool where a number is expected, a
            string for a number, ...) or is out of range; ``.field`` names the field.
    """

    chunk_size: int = DEFAULT_CHUNK_SIZE
    """Tokens per chunk; only the last chunk of a prompt may be shorter."""
    local_cpu: bool = DEFAULT_LOCAL_CPU
    """Whether the hot (CPU) cache is on at start."""
    max_local_cpu_size: float = DEFAULT_MAX_LOCAL_CPU_SIZE
    """Host memory for the arena, in GB (1 GB = 1024**3 bytes)."""
    save_unfull_chunk: bool = DEFAULT_SAVE_UNFULL_CHUNK
    """Whether the short last chunk of a prompt is stored."""
    prefault_pool: bool = DEFAULT_PREFAULT_POOL
    """Whether the host arena's pages are faulted in by a background thread once the engine
    opens (a fresh page's first write is several times slower than a later one); False:
    no page is touched before it is used."""
    hash_algorithm: str = DEFAULT_HASH_ALGORITHM
    """Chunk key hash: ``"blake3"`` or ``"xxh3_128"``."""
    pin_timeout: float = DEFAULT_PIN_TIMEOUT
    """Seconds before a lookup pin that was never released is released anyway."""
    allocation_timeout: float = DEFAULT_ALLOCATION_TIMEOUT
    """Seconds a store waits for host memory before storing the prefix it has."""
    retrieve_timeout: float = DEFAULT_RETRIEVE_TIMEOUT
    """Seconds a whole retrieve may take."""
    store_timeout: float = DEFAULT_STORE_TIMEOUT
    """Seconds a whole store may take."""
    pipeline_queue_size: int = DEFAULT_PIPELINE_QUEUE_SIZE
    """Capacity of each bounded stream between pipeline stages."""
    pipeline_batch_chunks: int = DEFAULT_PIPELINE_BATCH_CHUNKS
    """Chunks per pipeline item."""
    inline_copy_bytes: int = DEFAULT_INLINE_COPY_BYTES
    """Copies smaller than this run on the event loop, bigger ones in a worker thread."""
    inline_hash_tokens: int = DEFAULT_INLINE_HASH_TOKENS
    """Prompts shorter than this many tokens are hashed on the event loop."""
    enable_kv_events: bool = DEFAULT_ENABLE_KV_EVENTS
    """Whether chunk-stored / chunk-removed events are recorded."""
    max_kv_events: int = DEFAULT_MAX_KV_EVENTS
    """Undelivered events kept; beyond it the oldest are dropped and counted."""
    max_kv_event_bytes: int = DEFAULT_MAX_KV_EVENT_BYTES
    """Bytes of undelivered events kept (a stored event holds its tokens); beyond it the
    oldest are dropped and counted."""
    local_disk: str | None = DEFAULT_LOCAL_DISK
    """Directory of the disk tier (``file://`` prefix allowed); None: no disk tier."""
    max_local_disk_size: float = DEFAULT_MAX_LOCAL_DISK_SIZE
    """Capacity of the disk tier in GB; least recently used chunks are evicted beyond it."""
    remote_url: str | None = DEFAULT_REMOTE_URL
    """Redis/Valkey tier: ``redis://``, ``rediss://``, ``unix://``, ``valkey://`` or
    ``redis-cluster://host:port[,host:port...]``; None: no Redis tier."""
    remote_timeout: float = DEFAULT_REMOTE_TIMEOUT
    """Seconds every Redis call may take before the tier counts as failing."""
    remote_ttl: float | None = DEFAULT_REMOTE_TTL
    """Seconds a chunk lives in Redis; None: until Redis evicts it."""
    tier_codec: str = DEFAULT_TIER_CODEC
    """Payload encoding on disk and in Redis: ``none``, ``zstd``, ``lz4`` (lossless) or
    ``int8`` (lossy, per-channel scale)."""
    store_location: tuple[str, ...] | None = DEFAULT_STORE_LOCATION
    """Tiers a store writes to (``cpu``, ``disk``, ``redis``); None: every enabled tier."""
    retrieve_locations: tuple[str, ...] | None = DEFAULT_RETRIEVE_LOCATIONS
    """Tiers lookups and retrieves read from; None: every enabled tier."""
    wait_for_slow_tiers: bool = DEFAULT_WAIT_FOR_SLOW_TIERS
    """Whether a store waits until disk and Redis hold its chunks (else they are written
    behind it through a bounded queue)."""
    slow_tier_queue_size: int = DEFAULT_SLOW_TIER_QUEUE_SIZE
    """Batches of chunks queued for each slow tier; beyond it writes are skipped, counted."""
    store_threshold: int = DEFAULT_STORE_THRESHOLD
    """Sightings of a chunk's prefix before it goes to disk and Redis (a lookup of a
    prompt is one, a store of a chunk never seen one); until then a store keeps it in the
    CPU tier only, and the lookup that brings it to the threshold writes it behind. 1:
    every stored chunk goes to every tier at once. Sightings are counted for the chunks
    of about eight CPU tiers (4096 to 262144 chunks), the least recently seen forgotten."""
    health_check_interval: float = DEFAULT_HEALTH_CHECK_INTERVAL
    """Seconds between probes of each slow tier."""
    remove_after_retrieve: bool = DEFAULT_REMOVE_AFTER_RETRIEVE
    """Receiver role of disaggregated prefill: chunks are removed once retrieved."""
    use_layerwise: bool = DEFAULT_USE_LAYERWISE
    """Whether the serving engine stores and retrieves layer by layer."""
    tenant_quotas: TenantQuotas | None = DEFAULT_TENANT_QUOTAS
    """GB each tenant may hold in each tier (:mod:`lmcache_async.tenancy.quotas`): a mapping
    ``{tier: {tenant: GB, "*": GB}}`` or the text ``cpu.alice=1.5,cpu.*=0.5``; None: no
    quotas."""
    tenant_labels: TenantLabels | None = DEFAULT_TENANT_LABELS
    """How figures and logs show tenants (:mod:`lmcache_async.tenancy.labels`): a mapping
    ``{tenant name: label}``; a tenant without a label is shown by its tag's hex, never by
    its name (a ``cache_salt`` is a secret)."""
    encryption_key_file: str | None = DEFAULT_ENCRYPTION_KEY_FILE
    """A file holding a 32-byte master key (raw, or 64 hex characters): disk and Redis
    records are then encrypted (AES-GCM, a key per tenant); None: stored in the clear."""
    log_level: str | None = DEFAULT_LOG_LEVEL
    """``DEBUG``, ``INFO``, ``WARNING`` or ``ERROR`` (any case; stored upper-case): the
    level an engine sets, when it opens, on the library's own logger ``lmcache_async``
    (``logging.getLogger("lmcache_async").setLevel``), not a global setting: the host's root
    logger and handlers are left alone, and with no handler configured the library's
    records go to stderr (:func:`lmcache_async.logging.set_library_log_level`). None: the
    host's ``logging`` configuration decides (WARNING and above when it has none)."""
    log_format: str = DEFAULT_LOG_FORMAT
    """``"console"`` or ``"json"``."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = check_value(field.name, _TYPES[str(field.type)], getattr(self, field.name))
            # Frozen: normalised values (int -> float, level case) go through object.
            object.__setattr__(self, field.name, value)
        if self.tenant_quotas is not None:
            _check_quota_capacity(self)

    @property
    def cpu_capacity_bytes(self) -> int:
        """``max_local_cpu_size`` in bytes (rounded down)."""
        return int(self.max_local_cpu_size * GB)

    @property
    def disk_capacity_bytes(self) -> int:
        """``max_local_disk_size`` in bytes (rounded down)."""
        return int(self.max_local_disk_size * GB)

    @property
    def disk_directory(self) -> str | None:
        """``local_disk`` without a ``file://`` prefix, or None when there is no disk tier."""
        if self.local_disk is None:
            return None
        return self.local_disk.removeprefix("file://")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Names of every configuration field, in declaration order."""
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineConfig:
        """Build a config from a mapping of field names to values.

        Raises:
            ConfigError: a key is not a field (the message suggests the closest name), or
                a value is invalid.
        """
        _check_keys(data, source="configuration key")
        return cls(**data)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> EngineConfig:
        """Build a config from a YAML file holding a mapping of field names to values.

        An empty file is an empty mapping (all defaults).

        Raises:
            ConfigError: ``field="config_file"`` when the file is missing, unreadable, not
                valid YAML or not a mapping; otherwise as :meth:`from_dict`.
        """
        return cls.from_dict(_read_yaml(path))

    @classmethod
    def env_overrides(cls, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Parse ``LMCACHE_ASYNC_<FIELD>`` variables into a mapping of field values.

        Values are parsed by the field's type: bools from ``1/0/true/false/yes/no/on/off``
        (any case), ints, floats and strings. ``LMCACHE_ASYNC_CONFIG_FILE`` is skipped (it
        names a file, see :meth:`load`). Ranges are checked later, when a config is built.

        Args:
            environ: the environment to read; ``os.environ`` when None.

        Raises:
            ConfigError: a value does not parse (``.field`` is the field name, e.g.
                ``"chunk_size"``), or an ``LMCACHE_ASYNC_*`` variable names no field
                (``.field`` is the variable name).
        """
        env = os.environ if environ is None else environ
        types = {field.name: _TYPES[str(field.type)] for field in dataclasses.fields(cls)}
        overrides: dict[str, Any] = {}
        for var, raw in env.items():
            if not var.startswith(ENV_PREFIX) or var == CONFIG_FILE_ENV:
                continue
            name = var[len(ENV_PREFIX) :].lower()
            if name not in types:
                known = [ENV_PREFIX + n.upper() for n in types] + [CONFIG_FILE_ENV]
                raise ConfigError(var, "unknown environment variable" + _suggest(var, known))
            overrides[name] = parse_env(name, types[name], raw)
        return overrides

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> EngineConfig:
        """Build a config from every source, later ones winning.

        Precedence: defaults < YAML file (``path``, or else the file named by
        ``LMCACHE_ASYNC_CONFIG_FILE``) < ``LMCACHE_ASYNC_<FIELD>`` variables < keyword
        ``overrides``. Only the merged result is range-checked, so a later source may fix
        an earlier one.

        Args:
            path: YAML file to read; None to use ``LMCACHE_ASYNC_CONFIG_FILE`` if set.
            environ: the environment to read; ``os.environ`` when None.
            overrides: field values that win over every other source.

        Raises:
            ConfigError: as :meth:`from_file`, :meth:`env_overrides` and :meth:`from_dict`.
        """
        env = os.environ if environ is None else environ
        if path is None:
            path = env.get(CONFIG_FILE_ENV) or None
        merged: dict[str, Any] = {}
        if path is not None:
            merged.update(_read_yaml(path))
        merged.update(cls.env_overrides(env))
        _check_keys(overrides, source="override")
        merged.update(overrides)
        return cls.from_dict(merged)

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain Python values (tier lists as lists); round-trips through
        :meth:`from_dict` and YAML."""
        out: dict[str, Any] = {}
        for name in self.field_names():
            value = getattr(self, name)
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, TenantQuotas | TenantLabels):
                value = value.to_dict()
            out[name] = value
        return out

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` applied, validated like a new config.

        Raises:
            ConfigError: a key is not a field, or a value is invalid.
        """
        _check_keys(changes, source="configuration key")
        return dataclasses.replace(self, **changes)


def _suggest(word: str, candidates: list[str]) -> str:
    """A "did you mean" tail for an error message, or "" when nothing is close."""
    close = difflib.get_close_matches(word, candidates, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_keys(data: Mapping[Any, Any], *, source: str) -> None:
    """Raise ConfigError for the first key of ``data`` that is not a field name."""
    names = EngineConfig.field_names()
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(repr(key), f"{source} must be a string")
        if key not in names:
            raise ConfigError(key, f"unknown {source}" + _suggest(key, list(names)))


def _check_quota_capacity(config: EngineConfig) -> None:
    """ConfigError when a quota names a tier that is off or is larger than its tier (the
    Redis tier's size is the server's, checked when it is reached)."""
    quotas = config.tenant_quotas
    assert quotas is not None
    sizes = {"cpu": (config.cpu_capacity_bytes, "max_local_cpu_size")}
    if config.local_disk is not None:
        sizes["disk"] = (config.disk_capacity_bytes, "max_local_disk_size")
    for tier, quota in quotas.tiers.items():
        if tier == "redis":
            if config.remote_url is None:
                raise ConfigError("tenant_quotas.redis", "there is no Redis tier (remote_url)")
            continue
        if tier not in sizes:
            raise ConfigError(f"tenant_quotas.{tier}", "there is no disk tier (local_disk)")
        capacity, setting = sizes[tier]
        if quota.largest > capacity:
            raise ConfigError(
                f"tenant_quotas.{tier}",
                f"a quota of {quota.largest / GB:g} GB is larger than the tier "
                f"({setting} = {capacity / GB:g} GB)",
            )
        if quota.named_total > capacity:
            # Named tenants within their quotas are never evicted for another: the tier
            # must be able to hold all of them.
            raise ConfigError(
                f"tenant_quotas.{tier}",
                f"the named tenants' quotas add up to {quota.named_total / GB:g} GB, more "
                f"than the tier ({setting} = {capacity / GB:g} GB)",
            )


def _read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML mapping of field values; ConfigError(field="config_file") if it fails.

    Keys are checked here so an unknown key names the file it came from; values are
    checked when the config is built.
    """
    where = os.fspath(path)
    try:
        with open(where, encoding="utf-8") as f:
            document = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError("config_file", f"cannot read {where!r}: {exc.strerror}") from exc
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError("config_file", f"{where!r} is not valid YAML: {exc}") from exc
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ConfigError(
            "config_file",
            f"{where!r} must hold a mapping of settings, not {type(document).__name__}",
        )
    _check_keys(document, source=f"configuration key in {where!r}")
    return document
