"""CURVE keys and certificates: what a server encrypts with and what a client proves itself by.

A sidecar started with a secret key (``serve --curve-secret-key-file``) is a CURVE server;
its clients name its public key and prove who they are with a certificate of their own, a
``zmq.auth`` secret certificate (``zmq.auth.create_certificates`` writes a pair: ``NAME.key``
holds the public key only, ``NAME.key_secret`` both). The server admits a client only when
its public certificate is on an allow-list (:mod:`lmcache_async.rpc.sidecar.access`).

Key files are a certificate or a file holding just the 40-character z85 key. Reading one is
a few hundred bytes, done once when a client or server is configured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import zmq

from lmcache_async.errors import ConfigError

__all__ = [
    "CurveClientKeys",
    "load_client_certificate",
    "load_curve_public_key",
    "load_curve_secret_key",
]

_Z85_KEY_CHARS: Final = 40


def _read(path: str, field: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not a text file"
        raise ConfigError(field, f"cannot read {path!r}: {reason}") from exc


def _certificate(path: str) -> tuple[bytes | None, bytes | None]:
    """The (public, secret) z85 keys of a ``zmq.auth`` certificate file; None for either
    that it does not hold (or when the file is not a certificate)."""
    from zmq.auth import load_certificate  # noqa: PLC0415  (certificate files only)

    try:
        public, secret = load_certificate(path)
    except (ValueError, OSError):
        return None, None
    return public or None, secret or None


def _bare_key(text: str) -> bytes | None:
    stripped = text.strip()
    if len(stripped) == _Z85_KEY_CHARS and "\n" not in stripped:
        return stripped.encode("ascii", "replace")
    return None


def load_curve_secret_key(path: str, *, field: str = "curve_secret_key_file") -> bytes:
    """The z85 CURVE secret key in ``path``: a secret certificate or the bare key.

    Raises:
        ConfigError: ``field``: unreadable, no secret key, or not a valid key.
    """
    key = _bare_key(_read(path, field)) or _certificate(path)[1]
    if not key or len(key) != _Z85_KEY_CHARS:
        raise ConfigError(field, f"{path!r} holds no 40-character z85 CURVE secret key")
    try:
        zmq.curve_public(key)
    except (zmq.ZMQError, ValueError) as exc:
        raise ConfigError(field, f"{path!r}: invalid CURVE secret key: {exc}") from exc
    return key


def load_curve_public_key(path: str, *, field: str = "curve_public_key_file") -> bytes:
    """The z85 CURVE public key in ``path``: a certificate (public or secret) or the bare key.

    Raises:
        ConfigError: ``field``: unreadable, or no public key.
    """
    key = _bare_key(_read(path, field)) or _certificate(path)[0]
    if not key or len(key) != _Z85_KEY_CHARS:
        raise ConfigError(field, f"{path!r} holds no 40-character z85 CURVE public key")
    return key


@dataclass(frozen=True, slots=True)
class CurveClientKeys:
    """What a CURVE client socket needs: the server's public key and the client's own
    key pair (all z85). Without a certificate of its own a client makes a fresh pair,
    which a server with an allow-list refuses: it is for servers that encrypt only."""

    server_public: bytes
    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # the secret key stays out of logs and tracebacks
        return f"CurveClientKeys(server_public={self.server_public!r}, public={self.public!r})"

    @classmethod
    def make(cls, server_public: bytes, certificate: str | None) -> CurveClientKeys:
        """The keys of a client of the server with ``server_public``, proving itself with
        the secret certificate at ``certificate`` (None: a fresh key pair).

        Raises:
            ConfigError: ``field="client_certificate"``: unreadable or no secret key.
        """
        if certificate is None:
            public, secret = zmq.curve_keypair()
            return cls(server_public, public, secret)
        return cls(server_public, *load_client_certificate(certificate))

    def apply(self, socket: zmq.Socket[Any]) -> None:
        """Make ``socket`` (before it connects) a CURVE client with these keys."""
        socket.curve_serverkey = self.server_public
        socket.curve_publickey = self.public
        socket.curve_secretkey = self.secret


def load_client_certificate(path: str, *, field: str = "client_certificate") -> tuple[bytes, bytes]:
    """The (public, secret) z85 key pair of the secret certificate at ``path``.

    Raises:
        ConfigError: ``field``: unreadable, a public certificate (no secret key), or keys
            that do not belong together.
    """
    _read(path, field)
    public, secret = _certificate(path)
    if secret is None or len(secret) != _Z85_KEY_CHARS:
        raise ConfigError(
            field,
            f"{path!r} is not a secret certificate (zmq.auth.create_certificates writes "
            "NAME.key_secret for the client and NAME.key for the server's allow-list)",
        )
    try:
        derived = zmq.curve_public(secret)
    except (zmq.ZMQError, ValueError) as exc:
        raise ConfigError(field, f"{path!r}: invalid CURVE secret key: {exc}") from exc
    if public is not None and public != derived:
        raise ConfigError(field, f"{path!r}: its public key does not match its secret key")
    return derived, secret
