"""Opening an engine's tiers from its config: which are enabled, and how records look."""

from __future__ import annotations

from lmcache_async.memory.pool import MemoryPool
from lmcache_async.tenancy.tenants import TenantLimits

from ..backends.base import StorageBackend
from ..backends.cipher import RecordCipher
from ..backends.codec import Codec
from ..backends.disk import DiskBackend
from ..backends.record import RecordSpec
from ..config import EngineConfig
from ..errors import ConfigError
from ..layouts import KVFormat, KVLayout, LayoutKind

__all__ = [
    "check_tier_settings",
    "open_slow_tiers",
    "record_cipher",
    "record_spec",
    "tier_limits",
]


def check_tier_settings(config: EngineConfig) -> None:
    """Raise ConfigError when a location names a tier the config does not enable."""
    enabled = {"cpu"}
    if config.local_disk is not None:
        enabled.add("disk")
    if config.remote_url is not None:
        enabled.add("redis")
    for name in ("store_location", "retrieve_locations"):
        for tier in getattr(config, name) or ():
            if tier not in enabled:
                raise ConfigError(
                    name, f"tier {tier!r} is not enabled (set local_disk / remote_url for it)"
                )


def record_cipher(config: EngineConfig) -> RecordCipher | None:
    """The cipher of an engine's disk and Redis records: from the config's
    ``encryption_key_file`` (read here, once per engine), None when it names none.

    Raises:
        ConfigError: the key file cannot be read or holds no valid key.
    """
    key_file = config.encryption_key_file
    return None if key_file is None else RecordCipher.from_key_file(key_file)


def record_spec(
    config: EngineConfig,
    layout: KVLayout,
    codec: Codec | None = None,
    cipher: RecordCipher | None = None,
) -> RecordSpec:
    """How an engine's chunks are written to disk and Redis (``codec``: the config's
    ``tier_codec`` unless given; sealed with ``cipher`` when there is one, see
    :func:`record_cipher`)."""
    return RecordSpec(
        fingerprint=layout.fingerprint,
        fmt=str(layout.fmt),
        dtype=layout.dtype,
        max_tokens=config.chunk_size,
        shape_of=layout.payload_shape,
        codec=Codec(config.tier_codec) if codec is None else codec,
        layer_fmt=str(KVFormat.KV_MLA if layout.kind is LayoutKind.MLA else KVFormat.KV_T2D),
        layer_shape_of=layout.layer_payload_shape,
        cipher=cipher,
    )


def tier_limits(config: EngineConfig, tier: str) -> TenantLimits | None:
    """The tenant quotas of ``tier`` by tag, or None when it has none."""
    quotas = config.tenant_quotas
    quota = None if quotas is None else quotas.tier(tier)
    return None if quota is None else TenantLimits(quota)


async def open_slow_tiers(
    config: EngineConfig, pool: MemoryPool, spec: RecordSpec
) -> list[StorageBackend]:
    """Open the disk and Redis tiers the config enables, fastest first.

    Raises:
        ConfigError: a tier cannot start with its settings (the field is named).
    """
    tiers: list[StorageBackend] = []
    try:
        directory = config.disk_directory
        if directory is not None:
            tiers.append(
                await DiskBackend.open(
                    directory,
                    pool=pool,
                    spec=spec,
                    allocation_timeout=config.allocation_timeout,
                    max_local_disk_size=config.disk_capacity_bytes,
                    limits=tier_limits(config, "disk"),
                )
            )
        if config.remote_url is not None:
            try:
                from ..backends.redis import RedisBackend  # noqa: PLC0415 (optional extra)
            except ImportError as exc:
                raise ConfigError(
                    "remote_url",
                    "the Redis tier needs redis-py: pip install 'lmcache-async[redis]'",
                ) from exc
            tiers.append(
                await RedisBackend.open(
                    config.remote_url,
                    pool=pool,
                    spec=spec,
                    allocation_timeout=config.allocation_timeout,
                    timeout=config.remote_timeout,
                    ttl=config.remote_ttl,
                    limits=tier_limits(config, "redis"),
                )
            )
    except BaseException:
        for tier in tiers:
            await tier.aclose()
        raise
    return tiers
