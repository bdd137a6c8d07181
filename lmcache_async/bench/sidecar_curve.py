"""The CURVE side of the sidecar benchmark: certificates for a sidecar that serves only an
allow-list, and the flags that start it on loopback tcp.

``bench --sidecar --curve`` runs the same work through such a sidecar beside the plain one,
so the cost of encryption and authentication is a ratio of one run.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import zmq.auth

__all__ = ["CurveFiles", "free_loopback_port", "make_curve_files"]


@dataclass(frozen=True, slots=True)
class CurveFiles:
    """A server certificate and one allowed client's, written under one directory."""

    server_secret: str
    """The server's secret certificate (``--curve-secret-key-file``)."""
    server_public_key: bytes
    clients: str
    """The directory of allowed public certificates (``--curve-clients``)."""
    client_secret: str
    """The client's secret certificate (``client_certificate=``)."""

    def serve_flags(self) -> list[str]:
        """The ``lmcache-async serve`` flags of a CURVE sidecar with this allow-list; the
        client is an admin too (the benchmark clears the cache between runs)."""
        return [
            "--curve-secret-key-file",
            self.server_secret,
            "--curve-clients",
            self.clients,
            "--curve-admins",
            self.clients,
        ]


def make_curve_files(directory: str) -> CurveFiles:
    """Create a server key pair and one client's in ``directory`` (made if missing)."""
    servers = os.path.join(directory, "server")
    clients = os.path.join(directory, "clients")
    secrets = os.path.join(directory, "client")
    for path in (servers, clients, secrets):
        os.makedirs(path, exist_ok=True)
    public, secret = zmq.auth.create_certificates(servers, "sidecar")
    client_public, client_secret = zmq.auth.create_certificates(secrets, "bench")
    os.replace(client_public, os.path.join(clients, "bench.key"))
    key, _ = zmq.auth.load_certificate(public)
    return CurveFiles(secret, key, clients, client_secret)


def free_loopback_port() -> int:
    """A tcp port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
