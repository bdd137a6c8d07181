"""How a client reaches its sidecar (:class:`ClientSettings`), checked once when built,
and the HELLO it introduces itself with."""

from __future__ import annotations

import math
import os
import socket as socketlib
from dataclasses import dataclass, field
from typing import Any, Final

from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.chunks import Namespace
from lmcache_async.layouts import KVLayout
from lmcache_async.rpc.curve import CurveClientKeys
from lmcache_async.rpc.protocol import PROTOCOL_VERSION, MessageLimits
from lmcache_async.rpc.transport import boot_id

__all__ = [
    "DEFAULT_CLIENT_LIMITS",
    "DEFAULT_RECONNECT_INTERVAL",
    "DEFAULT_TIMEOUT",
    "ClientSettings",
]

DEFAULT_TIMEOUT: Final = 5.0
"""Seconds any one request may take before it counts as a miss."""
DEFAULT_RECONNECT_INTERVAL: Final = 0.5
"""Seconds between hellos while the sidecar is unreachable."""
DEFAULT_CLIENT_LIMITS: Final = MessageLimits(max_header_bytes=4 << 20, max_payload_bytes=1 << 30)
"""Replies a client accepts: a 4 MiB header and 1 GiB of inline payload."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientSettings:
    """The arguments of :class:`~lmcache_async.rpc.client.RemoteCacheEngine`, checked.

    Raises:
        InvalidInputError: naming the first bad argument.
    """

    url: str
    layout: KVLayout
    model_name: str
    revision: str | None = None
    tenant: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    server_public_key: bytes | str | None = None
    client_certificate: str | tuple[bytes, bytes] | None = None
    """The path of this client's ``zmq.auth`` secret certificate, or its (public, secret)
    z85 key pair; None: a fresh key pair (refused by a sidecar with an allow-list)."""
    shared_memory: bool | None = None
    stream: bool = True
    """Reach an ``ipc://`` sidecar over its same-host stream socket when it has one
    (:mod:`~lmcache_async.rpc.stream`); False: always ZeroMQ."""
    reconnect_interval: float = DEFAULT_RECONNECT_INTERVAL
    name: str | None = None
    limits: MessageLimits = DEFAULT_CLIENT_LIMITS
    curve: CurveClientKeys | None = field(default=None, init=False, repr=False)
    """The CURVE keys the socket uses (None: no CURVE), from the two arguments above."""

    def __post_init__(self) -> None:
        url = self.url
        if not isinstance(url, str) or not url.startswith(("ipc://", "tcp://")):
            raise InvalidInputError(f"url must be ipc://PATH or tcp://HOST:PORT, got {url!r:.80}")
        if not isinstance(self.layout, KVLayout):
            raise InvalidInputError("layout must be a KVLayout")
        if not isinstance(self.model_name, str) or not self.model_name:
            raise InvalidInputError("model_name must be a non-empty string")
        for label in ("revision", "tenant", "name"):
            value = getattr(self, label)
            if value is not None and not isinstance(value, str):
                raise InvalidInputError(f"{label} must be a str or None, got {value!r:.40}")
        for label in ("timeout", "reconnect_interval"):
            number = getattr(self, label)
            if (
                isinstance(number, bool)
                or not isinstance(number, (int, float))
                or not math.isfinite(number)
                or number <= 0
            ):
                raise InvalidInputError(f"{label} must be a positive number, got {number!r}")
        if self.shared_memory is not None and not isinstance(self.shared_memory, bool):
            raise InvalidInputError("shared_memory must be True, False or None (auto)")
        if not isinstance(self.stream, bool):
            raise InvalidInputError(f"stream must be True or False, got {self.stream!r:.40}")
        key = self.server_key
        if key is not None and (not isinstance(key, bytes) or len(key) != 40):
            raise InvalidInputError("server_public_key must be a 40-character z85 CURVE key")
        if not isinstance(self.limits, MessageLimits):
            raise InvalidInputError("limits must be a MessageLimits")
        object.__setattr__(self, "curve", self._curve_keys(key))

    def _curve_keys(self, server_key: bytes | None) -> CurveClientKeys | None:
        """The socket's CURVE keys (reads the certificate file, a few hundred bytes).

        Raises:
            InvalidInputError: a certificate without the server's key, or a bad key pair.
            ConfigError: ``field="client_certificate"``: the file cannot be used.
        """
        given = self.client_certificate
        if server_key is None:
            if given is not None:
                raise InvalidInputError("client_certificate needs server_public_key")
            return None
        if given is None or isinstance(given, str):
            return CurveClientKeys.make(server_key, given)
        if (
            not isinstance(given, tuple)
            or len(given) != 2
            or not all(isinstance(k, bytes) and len(k) == 40 for k in given)
        ):
            raise InvalidInputError(
                "client_certificate must be a certificate's path or a (public, secret) pair "
                "of 40-character z85 keys"
            )
        return CurveClientKeys(server_key, given[0], given[1])

    @property
    def server_key(self) -> bytes | None:
        """The server's z85 CURVE public key as bytes (None: no CURVE)."""
        key = self.server_public_key
        return key.encode("ascii") if isinstance(key, str) else key

    def hello(self) -> dict[str, Any]:
        """The HELLO header: the namespace asked for, and who this client is and where."""
        return {
            "model_name": self.model_name,
            "revision": self.revision,
            "tenant": self.tenant,
            "layout": self.layout.to_dict(),
            "client": self.name or f"{socketlib.gethostname()}:{os.getpid()}",
            "host": socketlib.gethostname(),
            "boot_id": boot_id(),
            "pid": os.getpid(),
            "protocol": PROTOCOL_VERSION,
        }

    def key_namespace(self) -> Namespace:
        """The namespace chunk keys are hashed in (as the server hashes them)."""
        return Namespace(
            model_name=self.model_name,
            layout_fingerprint=self.layout.fingerprint,
            revision=self.revision,
            tenant_salt=self.tenant,
        )
