"""The connector's configuration: ``kv_connector_extra_config`` split into the engine's
settings and the connector's own keys, and the cache engine those settings open.

``kv_connector_extra_config`` holds :class:`~lmcache_async.config.EngineConfig` fields plus
the connector's own keys (:data:`CONNECTOR_KEYS`); ``LMCACHE_ASYNC_*`` environment variables
and a YAML file (``config_file``) are merged as by :meth:`EngineConfig.load`, the extra
config winning.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from lmcache_async.config import EngineConfig
from lmcache_async.engine.client import check_promise_wait
from lmcache_async.errors import ConfigError, InvalidInputError
from lmcache_async.layouts import KVLayout
from lmcache_async.logging import get_logger
from lmcache_async.rpc.lookup import DEFAULT_LOOKUP_TIMEOUT, lookup_endpoint
from lmcache_async.sync.engine import DEFAULT_SIDECAR_TIMEOUT, SyncCacheEngine
from lmcache_async.tenancy.tenants import check_tenant

__all__ = [
    "CONNECTOR_KEYS",
    "DEFAULT_LOAD_TIMEOUT",
    "DEFAULT_PREFETCH_TIMEOUT",
    "DEFAULT_PROMISE_WAIT",
    "REQUEST_STATS_KEY",
    "SIDECAR_ENGINE_KEYS",
    "ConnectorSettings",
    "load_failure_policy_warning",
    "open_engine",
]

log = get_logger(__name__)

DEFAULT_PREFETCH_TIMEOUT: Final = 2.0
"""Seconds the scheduler waits for a prefetch into host memory before counting what came."""

DEFAULT_PROMISE_WAIT: Final = 0.02
"""Seconds a worker may wait, when the scheduler asks, for its disk or Redis reads to end
before it answers "pending" (vLLM then asks again only at its next step)."""

DEFAULT_LOAD_TIMEOUT: Final = 5.0
"""Seconds an asynchronous load may take before its blocks are reported invalid."""

CONNECTOR_KEYS: Final = (
    "config_file",
    "instance_id",
    "kv_events_tenants",
    "load_timeout",
    "lookup_timeout",
    "prefetch_timeout",
    "prefill_tokens_per_s",
    "promise_wait",
    "request_stats",
    "sidecar_client_certificate",
    "sidecar_events",
    "sidecar_server_key_file",
    "sidecar_timeout",
    "sidecar_url",
    "socket_dir",
    "store_decode_tokens",
    "tenant",
)
"""``kv_connector_extra_config`` keys read by the connector itself, not by the engine:

* ``config_file``: YAML file of engine settings (below the extra config in precedence);
* ``instance_id``: names the lookup sockets (default: vLLM's ``engine_id``);
* ``kv_events_tenants``: when true, the KV events vLLM publishes (with its
  ``--kv-events-config``) include named tenants' blocks (requests with a ``cache_salt``);
  by default they are left out, as their tokens are as private as their prompts;
* ``load_timeout``: seconds an asynchronous load (from host memory, between steps) may take
  (default 5); what has not arrived by then is reported as invalid blocks, which vLLM
  recomputes (with its ``kv_load_failure_policy="recompute"``);
* ``lookup_timeout``: seconds the scheduler waits for the workers' answer (then 0 hits);
* ``prefetch_timeout``: seconds the scheduler lets the workers bring a prompt's disk or
  Redis hits into host memory before it counts what arrived (default 2); until then vLLM
  is told to ask again and schedules other requests;
* ``promise_wait``: seconds a worker may wait for those reads to end when the scheduler
  asks, before it answers that they are still under way (default 0.02; 0: never wait).
  The scheduler waits that long at most per ask, where a "pending" answer costs the
  request a whole engine step;
* ``prefill_tokens_per_s``: the serving engine's prefill speed (a number > 0), which the
  load-or-recompute decision weighs loads against; unset, the workers measure it from
  vLLM's steps;
* ``request_stats``: when true, each finished request's ``kv_transfer_params`` carry
  ``{"lmcache_async": {...}}`` with its external, loaded, failed and stored token counts;
* ``sidecar_url``: ``ipc://PATH`` or ``tcp://HOST:PORT`` of a sidecar (``lmcache-async
  serve``): the workers keep their cache there instead of in an embedded engine. The
  sidecar owns the tiers, so the only engine keys allowed beside it are
  :data:`SIDECAR_ENGINE_KEYS` (``chunk_size`` must be the sidecar's);
* ``sidecar_server_key_file``: the sidecar's CURVE public key (its public certificate or
  the bare z85 key), for a sidecar started with ``--curve-secret-key-file``;
* ``sidecar_client_certificate``: the ``zmq.auth`` secret certificate the workers prove
  themselves with; its public half must be in the sidecar's ``--curve-clients``;
* ``sidecar_events``: the sidecar's KV event socket (its ``serve --events URL``): with
  vLLM's ``--kv-events-config``, the workers read it and vLLM publishes the sidecar's
  blocks beside its own (an embedded engine's are published without it);
* ``sidecar_timeout``: seconds each request to the sidecar may take (default 5); a sidecar
  that does not answer in time is a miss;
* ``socket_dir``: directory of the lookup sockets (default: the temporary directory);
* ``store_decode_tokens``: when true, a finished request's generated tokens are stored too
  (its whole chunks beyond the prompt, stored as it finishes; default false: prompts only);
* ``tenant``: the tenant of requests without a ``cache_salt``; a request's tenant (its
  ``cache_salt``, else this) is bound into its chunk keys, so tenants never share cache
  entries.
"""

SIDECAR_ENGINE_KEYS: Final = ("chunk_size", "save_unfull_chunk", "log_level", "log_format")
"""Engine keys the connector accepts with ``sidecar_url``: the scheduler side plans chunks
with them. Storage keys (tiers, sizes, timeouts) are the sidecar's own."""

REQUEST_STATS_KEY: Final = "lmcache_async"
"""Key of the per-request counts in ``kv_transfer_params`` (with ``request_stats``)."""


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The connector's configuration: the engine's settings and the connector's own keys."""

    engine: EngineConfig
    instance_id: str | None = None
    socket_dir: str | None = None
    lookup_timeout: float = DEFAULT_LOOKUP_TIMEOUT
    tenant: str | None = None
    request_stats: bool = False
    sidecar_url: str | None = None
    sidecar_timeout: float = DEFAULT_SIDECAR_TIMEOUT
    sidecar_server_key: bytes | None = None
    sidecar_client_certificate: str | None = None
    prefetch_timeout: float = DEFAULT_PREFETCH_TIMEOUT
    promise_wait: float = DEFAULT_PROMISE_WAIT
    load_timeout: float = DEFAULT_LOAD_TIMEOUT
    prefill_tokens_per_s: float | None = None
    store_decode_tokens: bool = False
    sidecar_events: str | None = None
    kv_events_tenants: bool = False

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any], *, environ: Mapping[str, str] | None = None
    ) -> ConnectorSettings:
        """Split ``kv_connector_extra_config`` into engine and connector settings.

        Raises:
            ConfigError: an unknown key (the message suggests the closest known one), a
                connector key of the wrong type or range, an invalid engine setting, or
                with ``sidecar_url`` a storage key or ``use_layerwise`` (the sidecar owns
                the tiers and moves whole chunks); ``.field`` names the key.
        """
        known = set(EngineConfig.field_names()) | set(CONNECTOR_KEYS)
        for key in extra:
            if not isinstance(key, str):
                raise ConfigError(repr(key), "kv_connector_extra_config keys must be strings")
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(key, "unknown kv_connector_extra_config key" + hint)
        own = {key: extra[key] for key in CONNECTOR_KEYS if key in extra}
        engine_keys = {key: value for key, value in extra.items() if key not in own}
        config_file = own.get("config_file")
        if config_file is not None and not isinstance(config_file, str):
            raise ConfigError("config_file", f"expected a path string, got {config_file!r}")
        engine = EngineConfig.load(config_file, environ=environ, **engine_keys)
        instance_id = _optional_str(own, "instance_id")
        socket_dir = _optional_str(own, "socket_dir")
        if instance_id is not None:
            try:
                lookup_endpoint(instance_id, 0, socket_dir)
            except InvalidInputError as exc:
                raise ConfigError("instance_id", str(exc)) from None
        timeout = _seconds(own, "lookup_timeout", DEFAULT_LOOKUP_TIMEOUT)
        request_stats = _flag(own, "request_stats")
        sidecar_url = _optional_str(own, "sidecar_url")
        if sidecar_url is not None:
            _check_sidecar(sidecar_url, engine, engine_keys)
        else:
            for key in (
                "sidecar_timeout",
                "sidecar_server_key_file",
                "sidecar_client_certificate",
                "sidecar_events",
            ):
                if key in own:
                    raise ConfigError(key, "only meaningful with sidecar_url")
        server_key, certificate = _sidecar_keys(own)
        promise_wait = own.get("promise_wait", DEFAULT_PROMISE_WAIT)
        try:
            promise_wait = check_promise_wait(promise_wait)
        except InvalidInputError as exc:
            raise ConfigError("promise_wait", str(exc)) from None
        if promise_wait >= timeout / 2:
            raise ConfigError(
                "promise_wait",
                f"{promise_wait} s must be under half the lookup_timeout ({timeout} s)",
            )
        return cls(
            engine=engine,
            instance_id=instance_id,
            socket_dir=socket_dir,
            lookup_timeout=timeout,
            tenant=_tenant(own),
            request_stats=request_stats,
            sidecar_url=sidecar_url,
            sidecar_timeout=_seconds(own, "sidecar_timeout", DEFAULT_SIDECAR_TIMEOUT),
            sidecar_server_key=server_key,
            sidecar_client_certificate=certificate,
            prefetch_timeout=_seconds(own, "prefetch_timeout", DEFAULT_PREFETCH_TIMEOUT),
            promise_wait=promise_wait,
            load_timeout=_seconds(own, "load_timeout", DEFAULT_LOAD_TIMEOUT),
            prefill_tokens_per_s=_speed(own, "prefill_tokens_per_s"),
            store_decode_tokens=_flag(own, "store_decode_tokens"),
            sidecar_events=_events_url(own),
            kv_events_tenants=_flag(own, "kv_events_tenants"),
        )


def _sidecar_keys(values: Mapping[str, Any]) -> tuple[bytes | None, str | None]:
    """The sidecar's CURVE public key and the workers' certificate path, both checked.

    Raises:
        ConfigError: a key file that holds no key, an unusable certificate, or a
            certificate without the sidecar's key.
    """
    from lmcache_async.rpc.curve import (  # noqa: PLC0415
        load_client_certificate,
        load_curve_public_key,
    )

    key_file = _optional_str(values, "sidecar_server_key_file")
    certificate = _optional_str(values, "sidecar_client_certificate")
    if certificate is not None:
        if key_file is None:
            raise ConfigError(
                "sidecar_client_certificate", "needs sidecar_server_key_file (the sidecar's key)"
            )
        load_client_certificate(certificate, field="sidecar_client_certificate")
    if key_file is None:
        return None, certificate
    return load_curve_public_key(key_file, field="sidecar_server_key_file"), certificate


def _events_url(values: Mapping[str, Any]) -> str | None:
    """The ``sidecar_events`` key: an ``ipc://`` or ``tcp://`` URL."""
    url = _optional_str(values, "sidecar_events")
    if url is not None:
        scheme, _, rest = url.partition("://")
        if scheme not in ("ipc", "tcp") or not rest:
            raise ConfigError(
                "sidecar_events", f"expected ipc://PATH or tcp://HOST:PORT, got {url!r}"
            )
    return url


def _seconds(values: Mapping[str, Any], key: str, default: float) -> float:
    value = values.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(key, f"expected a number of seconds > 0, got {value!r}")
    return float(value)


def _speed(values: Mapping[str, Any], key: str) -> float | None:
    value = values.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(key, f"expected a number of tokens per second > 0, got {value!r}")
    return float(value)


def _flag(values: Mapping[str, Any], key: str) -> bool:
    value = values.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(key, f"expected a bool, got {value!r}")
    return value


def load_failure_policy_warning(policy: str | None) -> str | None:
    """What vLLM's ``kv_load_failure_policy`` means for this connector's loads, when it is
    worth a warning (``"fail"``, vLLM's default); None otherwise."""
    if policy != "fail":
        return None
    return (
        'kv_load_failure_policy is "fail" (vLLM\'s default). Promised hits are verified in '
        "host memory before they are counted, so a corrupt or missing chunk never fails a "
        "request; but a load that fails after its promise (e.g. a sidecar killed in "
        'between) fails the request under "fail". Set kv_load_failure_policy="recompute" '
        "to have vLLM recompute it instead."
    )


def _check_sidecar(url: str, engine: EngineConfig, engine_keys: Mapping[str, Any]) -> None:
    """Refuse what a sidecar cannot honour: a bad URL, layerwise, storage keys here."""
    scheme, _, rest = url.partition("://")
    if scheme not in ("ipc", "tcp") or not rest:
        raise ConfigError("sidecar_url", f"expected ipc://PATH or tcp://HOST:PORT, got {url!r}")
    if engine.use_layerwise:
        raise ConfigError(
            "use_layerwise",
            "layerwise transfers are not offered over the sidecar; drop use_layerwise or "
            "sidecar_url",
        )
    for key in engine_keys:
        if key not in SIDECAR_ENGINE_KEYS:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(
                key,
                f"the sidecar at {url} owns the storage settings: give {flag} to "
                "`lmcache-async serve`, not to the connector",
            )


def _tenant(values: Mapping[str, Any]) -> str | None:
    """The ``tenant`` key: a name every tier can key (at most 256 UTF-8 bytes)."""
    tenant = _optional_str(values, "tenant")
    try:
        return check_tenant(tenant)
    except InvalidInputError as exc:
        raise ConfigError("tenant", str(exc)) from None


def _optional_str(values: Mapping[str, Any], key: str) -> str | None:
    value = values.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(key, f"expected a non-empty string, got {value!r}")
    return value


def open_engine(
    settings: ConnectorSettings,
    layout: KVLayout,
    *,
    model_name: str,
    revision: str | None,
    tenant: str | None,
) -> SyncCacheEngine:
    """The worker's cache engine over ``layout``: an embedded engine, or with
    ``sidecar_url`` a client of the sidecar.

    A sidecar that is down is not fatal: calls are misses until it answers (logged here).
    One that cuts chunks of another size would key every chunk differently: refused.

    Raises:
        ConfigError: the sidecar answers with another ``chunk_size`` than configured.
    """
    url = settings.sidecar_url
    if url is None:
        return SyncCacheEngine.open(
            settings.engine, layout, model_name=model_name, revision=revision, tenant=tenant
        )
    engine = SyncCacheEngine.connect(
        url,
        layout,
        model_name=model_name,
        revision=revision,
        tenant=tenant,
        timeout=settings.sidecar_timeout,
        server_public_key=settings.sidecar_server_key,
        client_certificate=settings.sidecar_client_certificate,
    )
    chunk = engine.chunk_size
    if chunk is None:
        log.warning("vllm_sidecar_unreachable", url=url, timeout=settings.sidecar_timeout)
    elif chunk != settings.engine.chunk_size:
        engine.close()
        raise ConfigError(
            "chunk_size",
            f"the sidecar at {url} cuts chunks of {chunk} tokens, the connector is "
            f"configured for {settings.engine.chunk_size}: set chunk_size to {chunk}",
        )
    return engine
