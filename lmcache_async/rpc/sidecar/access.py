"""Who may use a sidecar: the CURVE allow-lists, the ZAP handler that applies them, and the
role each admitted peer has.

A sidecar with a CURVE secret key admits a peer only when its public key is in a
certificate of ``--curve-clients DIR`` (role :attr:`Role.CLIENT`: store, retrieve, look up,
prefetch, promise, read figures without tenants) or ``--curve-admins DIR``
(:attr:`Role.ADMIN`: also erase, clear, freeze, hot-cache, move, shut down and read
per-tenant figures). pyzmq's :mod:`zmq.auth` answers the ZAP requests of every CURVE server
socket of the sidecar's context (the request socket and the event publisher); a refused
peer's handshake fails, so it never reaches a handler, and it holds nothing afterwards.
The admitted peer's role rides on each of its messages as the ZAP *User-Id*
(``"admin:<key>"`` / ``"client:<key>"``), read by :func:`peer_of`.

Without a secret key the sidecar is reached over a local socket (an ``ipc://`` file of mode
0600, or loopback tcp) and every peer is an admin: the host's users are the boundary.
"""

from __future__ import annotations

import enum
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from lmcache_async.errors import ConfigError
from lmcache_async.logging import get_logger

__all__ = ["AccessList", "Gatekeeper", "Peer", "Role", "peer_of"]

log = get_logger(__name__)

_USER_ID: Final = "User-Id"
_REFUSALS_REMEMBERED: Final = 4096
"""Refused peers remembered so each is logged once; more are counted, logged as they come."""


class Role(enum.IntEnum):
    """What an admitted peer may do; a higher role may do all a lower one may."""

    CLIENT = 1
    ADMIN = 2


@dataclass(frozen=True, slots=True)
class Peer:
    """An admitted peer: its role and its z85 public key (empty without CURVE)."""

    role: Role
    key: str = ""


LOCAL_ADMIN: Final = Peer(Role.ADMIN)
"""Every peer of a sidecar without CURVE."""


def _load_directory(path: str, field: str) -> frozenset[bytes]:
    """The z85 public keys of the ``zmq.auth`` certificates in directory ``path``.

    Raises:
        ConfigError: ``field``: not a readable directory, or no certificate in it.
    """
    from zmq.auth import load_certificates  # noqa: PLC0415

    if not os.path.isdir(path):
        raise ConfigError(field, f"{path!r} is not a directory of zmq.auth public certificates")
    try:
        keys = frozenset(load_certificates(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(field, f"cannot read the certificates in {path!r}: {exc}") from exc
    if not keys:
        raise ConfigError(
            field,
            f"{path!r} holds no certificate (NAME.key files from zmq.auth.create_certificates)",
        )
    return keys


@dataclass(frozen=True, slots=True)
class AccessList:
    """The public keys (z85) admitted as clients and as admins. A key in both is an admin.

    Raises:
        ConfigError: a key is not 40 z85 characters.
    """

    clients: frozenset[bytes]
    admins: frozenset[bytes] = frozenset()

    def __post_init__(self) -> None:
        for key in self.clients | self.admins:
            if not isinstance(key, bytes) or len(key) != 40:
                raise ConfigError("curve_clients", f"not a z85 CURVE public key: {key!r:.60}")

    @classmethod
    def load(cls, clients: str, admins: str | None = None) -> AccessList:
        """The allow-lists in directories of public certificates.

        Raises:
            ConfigError: ``field="curve_clients"`` / ``"curve_admins"``: a directory is
                missing, unreadable or holds no certificate.
        """
        admitted = _load_directory(clients, "curve_clients")
        return cls(admitted, _load_directory(admins, "curve_admins") if admins else frozenset())

    def role(self, key: bytes) -> Role | None:
        """The role of the peer with z85 public ``key`` (None: not admitted)."""
        if key in self.admins:
            return Role.ADMIN
        if key in self.clients:
            return Role.CLIENT
        return None


class _Authenticator(AsyncioAuthenticator):
    """pyzmq's asyncio ZAP handler, naming each admitted peer by role and key."""

    def __init__(self, context: zmq.asyncio.Context, access: AccessList) -> None:
        super().__init__(context)
        self._access = access

    def curve_user_id(self, client_public_key: bytes) -> str:
        key = zmq.utils.z85.encode(client_public_key)
        role = self._access.role(key)
        return f"{(role or Role.CLIENT).name.lower()}:{key.decode('ascii')}"


class Gatekeeper:
    """Runs the ZAP handler of ``context`` (on the running event loop) with ``access``;
    counts and logs refused peers (each logged once, as far as :data:`_REFUSALS_REMEMBERED`
    peers go). Use :meth:`start` and :meth:`stop`."""

    def __init__(self, context: zmq.asyncio.Context, access: AccessList) -> None:
        self.access = access
        self.refused = 0
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._auth = _Authenticator(context, access)

    def start(self) -> None:
        """Answer ZAP requests from now on (call before the server sockets bind)."""
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self)

    def stop(self) -> None:
        self._auth.stop()

    def callback(self, domain: str, key: bytes) -> bool:
        """Whether the peer with z85 public ``key`` is admitted (zmq.auth's credentials
        provider interface)."""
        if self.access.role(key) is not None:
            return True
        self.refused += 1
        if key not in self._seen:
            self._seen[key] = None
            if len(self._seen) > _REFUSALS_REMEMBERED:
                self._seen.popitem(last=False)
            log.warning("sidecar_peer_refused", key=key.decode("ascii", "replace"))
        return False


def peer_of(frame: zmq.Frame) -> Peer | None:
    """The admitted peer that sent the message ``frame`` belongs to, from its ZAP User-Id
    (None: the message carries none, as on a socket without CURVE)."""
    try:
        user = frame.get(_USER_ID)
    except zmq.ZMQError:
        return None
    role, _, key = str(user).partition(":")
    if role == "admin":
        return Peer(Role.ADMIN, key)
    if role == "client":
        return Peer(Role.CLIENT, key)
    return None
