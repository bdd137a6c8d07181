"""How a sidecar runs (:class:`SidecarSettings`) and what it serves (:class:`SidecarNamespace`).

Both are frozen value objects checked when built, so :func:`~lmcache_async.rpc.sidecar.serve`
never starts with a setting it would refuse later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Final

from lmcache_async.config import EngineConfig
from lmcache_async.errors import ConfigError, InvalidInputError
from lmcache_async.keys.tokens import is_strict_int
from lmcache_async.layouts import KVLayout
from lmcache_async.rpc.protocol import MessageLimits
from lmcache_async.rpc.transport import check_listen_url, default_endpoint

__all__ = [
    "DEFAULT_CLIENT_TIMEOUT_BEATS",
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_MAX_CONCURRENCY",
    "DEFAULT_SIDECAR_LIMITS",
    "SidecarNamespace",
    "SidecarSettings",
]

DEFAULT_HEARTBEAT_INTERVAL: Final = 1.0
"""Seconds between a client's heartbeats (told to the client in the HELLO reply)."""
DEFAULT_CLIENT_TIMEOUT_BEATS: Final = 5
"""A session silent for this many heartbeat intervals is dropped (default timeout): a few
missed beats, so a client whose event loop stalls for a moment keeps its session."""
DEFAULT_SIDECAR_LIMITS: Final = MessageLimits(max_header_bytes=4 << 20, max_payload_bytes=1 << 30)
"""Sidecar messages: a 4 MiB header (block hashes, chunk lists), 1 GiB of inline payload."""
DEFAULT_MAX_CONCURRENCY: Final = 64
"""Requests served at once; further ones wait in the socket's queue."""


@dataclass(frozen=True, slots=True)
class SidecarNamespace:
    """What one sidecar serves: a model (with weights revision and tenant) and KV layout.

    Two namespaces match when the model, revision and tenant are equal and the layouts have
    the same fingerprint (block size and memory order may differ: the payloads do not).
    """

    model_name: str
    layout: KVLayout
    revision: str | None = None
    tenant: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise InvalidInputError("model_name must be a non-empty string")
        if not isinstance(self.layout, KVLayout):
            raise InvalidInputError("layout must be a KVLayout")
        for name in ("revision", "tenant"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidInputError(f"{name} must be a str or None, got {value!r:.40}")

    @classmethod
    def from_wire(cls, header: dict[str, Any]) -> SidecarNamespace:
        """The namespace a HELLO header asks for.

        Raises:
            InvalidInputError: a field is missing or malformed.
        """
        return cls(
            model_name=header.get("model_name"),  # type: ignore[arg-type]
            layout=KVLayout.from_dict(header.get("layout")),
            revision=header.get("revision"),
            tenant=header.get("tenant"),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "revision": self.revision,
            "tenant": self.tenant,
            "layout": self.layout.to_dict(),
        }

    def mismatch(self, other: SidecarNamespace) -> str | None:
        """Why ``other`` cannot be served by a sidecar serving this one (None: it can)."""
        differences = [
            f"{name} {getattr(other, name)!r} (served: {getattr(self, name)!r})"
            for name in ("model_name", "revision", "tenant")
            if getattr(self, name) != getattr(other, name)
        ]
        if self.layout.fingerprint != other.layout.fingerprint:
            differences.append(
                f"layout {other.layout.fingerprint!r} (served: {self.layout.fingerprint!r})"
            )
        return "; ".join(differences) or None


@dataclass(frozen=True, slots=True)
class SidecarSettings:
    """How :func:`~lmcache_async.rpc.sidecar.serve` runs.

    ``client_timeout`` defaults to five heartbeat intervals. ``namespace`` opens the
    engine at start instead of at the first HELLO.

    Raises:
        ConfigError: a setting is invalid; ``.field`` names it.
    """

    listen: str = field(default_factory=default_endpoint)
    config: EngineConfig = field(default_factory=EngineConfig)
    namespace: SidecarNamespace | None = None
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    client_timeout: float | None = None
    allow_remote: bool = False
    curve_secret_key: bytes | None = None
    limits: MessageLimits = DEFAULT_SIDECAR_LIMITS
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    events: str | None = None
    """Where KV events are published (a PUB socket's ``ipc://`` or ``tcp://`` URL, loopback
    unless ``allow_remote``); None: not published."""
    metrics_port: int | None = None
    """Port of the Prometheus endpoint on loopback (0: any free one); None: no endpoint."""

    def __post_init__(self) -> None:
        check_listen_url(self.listen, allow_remote=self.allow_remote)
        if self.events is not None:
            try:
                check_listen_url(self.events, allow_remote=self.allow_remote)
            except ConfigError as exc:
                raise ConfigError("events", str(exc).removeprefix("listen: ")) from None
        if self.metrics_port is not None and (
            not is_strict_int(self.metrics_port) or not 0 <= self.metrics_port <= 65535
        ):
            raise ConfigError("metrics_port", f"expected a port number: {self.metrics_port!r}")
        if not isinstance(self.config, EngineConfig):
            raise ConfigError("config", "expected an EngineConfig")
        for name in ("heartbeat_interval", "client_timeout"):
            value = getattr(self, name)
            if value is None and name == "client_timeout":
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ConfigError(name, f"expected a positive number of seconds, got {value!r}")
        if not is_strict_int(self.max_concurrency) or self.max_concurrency <= 0:
            raise ConfigError("max_concurrency", f"expected a positive int: {self.max_concurrency}")
        if self.namespace is not None and not isinstance(self.namespace, SidecarNamespace):
            raise ConfigError("namespace", "expected a SidecarNamespace")

    @property
    def session_timeout(self) -> float:
        """Seconds after which a silent client's session is dropped."""
        if self.client_timeout is not None:
            return float(self.client_timeout)
        return DEFAULT_CLIENT_TIMEOUT_BEATS * self.heartbeat_interval
