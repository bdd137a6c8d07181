"""The sidecar cache server: a :class:`CacheEngine`'s storage tiers in a process of their own.

``lmcache-async serve`` runs :func:`serve`. Serving-engine workers connect with
:class:`~lmcache_async.rpc.client.RemoteCacheEngine` over a ROUTER socket (``ipc://`` by
default, ``tcp://`` on loopback unless remote binds are allowed, optionally CURVE-encrypted).

The server serves one namespace (model, revision, tenant, KV layout): the first client's
HELLO fixes it and opens the engine, unless :class:`SidecarSettings` names one; a client
asking for another is refused. The engine's host arena is a
:mod:`multiprocessing.shared_memory` segment, so a client on the same host copies KV bytes
straight into and out of the payloads the server allocates or holds:

- store: STORE (tokens or block hashes) → the server skips chunks it has, allocates the
  others and replies their offsets in a *transaction* → the client gathers its KV into
  them → COMMIT → the server puts them into its tiers and replies the tokens stored;
- retrieve: RETRIEVE → the server looks up and fetches the chunks (from disk or Redis too)
  and holds them in a transaction → the client scatters them into its KV memory →
  RELEASE (no reply) → the server lets them go.

A client on another host sends the payloads inline in the COMMIT and gets them inline in
the RETRIEVE reply.

Moves between instances (:meth:`CacheEngine.move <lmcache_async.CacheEngine.move>`):

- PUSH (tokens, then one inline payload per chunk with its xxh3-64 checksum) → the server
  copies each payload into its memory, checks the copy against the checksum, caches the
  leading run that passes (refusing a corrupt or mis-sized chunk and the rest), flushes
  queued tier writes and replies the tokens it took;
- MOVE (tokens, ``old_position``, ``new_position``, ``copy``) → the server's engine moves
  the prefix to the other sidecar (by PUSH) and replies the tokens moved.

Each client has a session, kept alive by its requests and heartbeats; a session silent for
``client_timeout`` seconds is dropped with its transactions and its lookup pins (lookup ids
are scoped per session). Every request runs in a task of its own; a bad message or a
failing request gets an ERROR reply and the server runs on. SIGTERM or SIGINT shut it down
in order: requests in flight finish (bounded), transactions end, queued tier writes are
flushed, the tiers close, the shared memory is unlinked and the ipc socket file removed.

Modules: :mod:`~.settings` (what a sidecar serves and how it runs), :mod:`~.host` (the
engine, opened in a task of its own), :mod:`~.sessions` (clients, their transactions and
pins), :mod:`~.routes` (what a handler is), the handlers by concern (:mod:`~.hello`,
:mod:`~.lookups`, :mod:`~.transfers`, :mod:`~.admin`, reading fields with
:mod:`~.fields`), :mod:`~.server` (routing and the socket loop) and :mod:`~.shell`
(:func:`serve`: the process around it).
"""

from __future__ import annotations

from lmcache_async.rpc.sidecar.server import SidecarServer
from lmcache_async.rpc.sidecar.settings import (
    DEFAULT_CLIENT_TIMEOUT_BEATS,
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_SIDECAR_LIMITS,
    SidecarNamespace,
    SidecarSettings,
)
from lmcache_async.rpc.sidecar.shell import SHUTDOWN_GRACE_SECONDS, serve

__all__ = [
    "DEFAULT_CLIENT_TIMEOUT_BEATS",
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_MAX_CONCURRENCY",
    "DEFAULT_SIDECAR_LIMITS",
    "SHUTDOWN_GRACE_SECONDS",
    "SidecarNamespace",
    "SidecarServer",
    "SidecarSettings",
    "serve",
]
