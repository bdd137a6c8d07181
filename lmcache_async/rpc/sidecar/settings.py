"""How a sidecar runs (:class:`SidecarSettings`) and what it serves (:class:`SidecarNamespace`).

Both are frozen value objects checked when built, so :func:`~lmcache_async.rpc.sidecar.serve`
never starts with a setting it would refuse later.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

from lmcache_async.config import EngineConfig
from lmcache_async.errors import ConfigError, InvalidInputError
from lmcache_async.keys.tokens import is_strict_int
from lmcache_async.layouts import KVLayout
from lmcache_async.rpc.protocol import MessageLimits
from lmcache_async.rpc.sidecar.access import AccessList
from lmcache_async.rpc.transport import check_listen_url, default_endpoint
from lmcache_async.tenancy.tenants import check_tenant

__all__ = [
    "DEFAULT_CLIENT_TIMEOUT_BEATS",
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_MAX_CONCURRENCY",
    "DEFAULT_MAX_PEER_REQUESTS",
    "DEFAULT_MAX_REQUEST_TIMEOUT",
    "DEFAULT_MAX_SESSION_PINS",
    "DEFAULT_MAX_SESSION_POOL_SHARE",
    "DEFAULT_MAX_SESSION_TRANSACTIONS",
    "MAX_NAME_CHARS",
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
DEFAULT_MAX_CONCURRENCY: Final = 256
"""Data requests served at once, all peers together; past it a request is answered
``busy`` at once (the socket is never left unread)."""
DEFAULT_MAX_PEER_REQUESTS: Final = 64
"""Data requests one peer may have in flight; past it, ``busy``."""
DEFAULT_MAX_SESSION_TRANSACTIONS: Final = 256
"""Transactions (stores before their COMMIT, loads before their RELEASE) one session may
hold open; past it a STORE or RETRIEVE is answered ``busy``."""
DEFAULT_MAX_SESSION_POOL_SHARE: Final = 0.5
"""The share of the host memory pool one session's open transactions may hold: a STORE
reserves no more than what keeps the session within it."""
DEFAULT_MAX_SESSION_PINS: Final = 4096
"""Lookup ids one session may hold pins under; past it a pinning request is ``busy``."""
DEFAULT_MAX_REQUEST_TIMEOUT: Final = 60.0
"""The longest wait a client may ask a request to take (its ``"timeout"``), in seconds:
a larger one is clamped to this."""
MAX_NAME_CHARS: Final = 1024
"""Longest model name or revision a namespace may have."""


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
        revision = self.revision
        if revision is not None and not isinstance(revision, str):
            raise InvalidInputError(f"revision must be a str or None, got {revision!r:.40}")
        for name, value in (("model_name", self.model_name), ("revision", revision)):
            if value is not None and len(value) > MAX_NAME_CHARS:
                raise InvalidInputError(
                    f"{name} must be at most {MAX_NAME_CHARS} characters, got {len(value)}"
                )
        check_tenant(self.tenant)

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

    ``curve_secret_key`` and ``access`` go together: a CURVE sidecar serves only the
    certificates on its allow-list (:mod:`~lmcache_async.rpc.sidecar.access`), and
    ``allow_remote`` needs both. ``move_targets`` maps each sidecar URL a MOVE may go to
    onto its CURVE public key (None: a target reached without CURVE, on this host only).

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
    access: AccessList | None = None
    move_targets: Mapping[str, bytes | None] = field(default_factory=dict)
    limits: MessageLimits = DEFAULT_SIDECAR_LIMITS
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    max_peer_requests: int = DEFAULT_MAX_PEER_REQUESTS
    max_session_transactions: int = DEFAULT_MAX_SESSION_TRANSACTIONS
    max_session_pins: int = DEFAULT_MAX_SESSION_PINS
    max_session_pool_share: float = DEFAULT_MAX_SESSION_POOL_SHARE
    max_request_timeout: float = DEFAULT_MAX_REQUEST_TIMEOUT
    events: str | None = None
    """Where KV events are published (a PUB socket's ``ipc://`` or ``tcp://`` URL, loopback
    unless ``allow_remote``); None: not published."""
    events_replay: str | None = None
    """Where batches missed by a subscriber are replayed (a ROUTER, vLLM's
    ``replay_endpoint`` convention); None: no replay."""
    events_topic: str = ""
    """The topic frame of every event batch (vLLM's default: empty)."""
    tenant_events: bool = False
    """Publish named tenants' events too (their tokens and digests); False: only the
    unnamed tenant's."""
    metrics_port: int | None = None
    """Port of the Prometheus endpoint on loopback (0: any free one); None: no endpoint."""
    stream: bool = True
    """Beside an ``ipc://`` address without CURVE keys, also listen on the same-host stream
    socket ``PATH.stream`` (:mod:`~lmcache_async.rpc.stream`); False: ZeroMQ only."""

    def __post_init__(self) -> None:
        check_listen_url(self.listen, allow_remote=self.allow_remote)
        if not isinstance(self.stream, bool):
            raise ConfigError("stream", f"expected True or False, got {self.stream!r:.40}")
        self._check_access()
        for name in ("events", "events_replay"):
            url = getattr(self, name)
            if url is not None:
                try:
                    check_listen_url(url, allow_remote=self.allow_remote)
                except ConfigError as exc:
                    raise ConfigError(name, str(exc).removeprefix("listen: ")) from None
        if self.events_replay is not None and self.events is None:
            raise ConfigError("events_replay", "a replay socket needs --events")
        if not isinstance(self.events_topic, str):
            raise ConfigError("events_topic", f"expected a str, got {self.events_topic!r:.40}")
        if self.metrics_port is not None and (
            not is_strict_int(self.metrics_port) or not 0 <= self.metrics_port <= 65535
        ):
            raise ConfigError("metrics_port", f"expected a port number: {self.metrics_port!r}")
        if not isinstance(self.config, EngineConfig):
            raise ConfigError("config", "expected an EngineConfig")
        share = self.max_session_pool_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise ConfigError("max_session_pool_share", f"expected a share in (0, 1]: {share!r}")
        for name in ("heartbeat_interval", "client_timeout", "max_request_timeout"):
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
        for name in (
            "max_concurrency",
            "max_peer_requests",
            "max_session_transactions",
            "max_session_pins",
        ):
            value = getattr(self, name)
            if not is_strict_int(value) or value <= 0:
                raise ConfigError(name, f"expected a positive int: {value!r}")
        if self.namespace is not None and not isinstance(self.namespace, SidecarNamespace):
            raise ConfigError("namespace", "expected a SidecarNamespace")

    def _check_access(self) -> None:
        """CURVE with an allow-list or neither; remote binds only with both; move targets
        well-formed (plain ones local only).

        Raises:
            ConfigError: naming the setting.
        """
        if self.access is not None and not isinstance(self.access, AccessList):
            raise ConfigError("curve_clients", "expected an AccessList")
        if self.curve_secret_key is not None and self.access is None:
            raise ConfigError(
                "curve_clients",
                "a CURVE sidecar needs an allow-list (--curve-clients DIR of public "
                "certificates): without one it would serve any key pair",
            )
        if self.access is not None and self.curve_secret_key is None:
            raise ConfigError("curve_clients", "an allow-list needs --curve-secret-key-file")
        if self.allow_remote and self.access is None:
            raise ConfigError(
                "allow_remote",
                "--allow-remote needs --curve-secret-key-file and --curve-clients: a sidecar "
                "reachable from other hosts must know who may use it",
            )
        if not isinstance(self.move_targets, Mapping):
            raise ConfigError("move_targets", "expected a mapping of URL to public key")
        for url, key in self.move_targets.items():
            if not isinstance(url, str) or not url.startswith(("ipc://", "tcp://")):
                raise ConfigError("move_targets", f"expected an ipc:// or tcp:// URL: {url!r:.80}")
            if key is None:
                try:
                    check_listen_url(url, allow_remote=False)
                except ConfigError:
                    raise ConfigError(
                        "move_targets",
                        f"{url} is not on this host: give its CURVE public key (URL=KEYFILE)",
                    ) from None
            elif not isinstance(key, bytes) or len(key) != 40:
                raise ConfigError("move_targets", f"not a z85 CURVE public key for {url}")
            elif self.curve_secret_key is None:
                raise ConfigError(
                    "move_targets",
                    f"{url} is reached over CURVE with this sidecar's own key pair: "
                    "give --curve-secret-key-file",
                )
        object.__setattr__(self, "move_targets", MappingProxyType(dict(self.move_targets)))

    @property
    def session_timeout(self) -> float:
        """Seconds after which a silent client's session is dropped."""
        if self.client_timeout is not None:
            return float(self.client_timeout)
        return DEFAULT_CLIENT_TIMEOUT_BEATS * self.heartbeat_interval
