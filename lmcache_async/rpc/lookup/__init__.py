"""The lookup service: the scheduler asks every worker rank how much of a prompt is cached.

Each worker process runs a :class:`LookupServer` (a ROUTER socket on an ``ipc://`` path
derived from an instance id and the rank) answering from its :class:`CacheEngine`. The
scheduler holds a :class:`LookupClient` (async) or :class:`SyncLookupClient` (blocking, for
vLLM's synchronous scheduler) with one DEALER socket per rank. A lookup goes to every rank
at once and the answer is the minimum, because a prefix is only usable when every rank has
its share of it. A rank that does not answer within the timeout counts as 0 hits (and is
logged); the call never hangs and never raises for it.

:class:`LookupServer` and :class:`LookupClient` run on asyncio only (``zmq.asyncio``), not
on trio.

Modules: :mod:`~.endpoint` (addresses, lookup ids, message limits), :mod:`~.server`
(:class:`LookupServer`), :mod:`~.core` (what both clients share),
:mod:`~.async_client` (:class:`LookupClient`) and :mod:`~.sync_client`
(:class:`SyncLookupClient`).
"""

from __future__ import annotations

from lmcache_async.rpc.lookup.async_client import LookupClient
from lmcache_async.rpc.lookup.core import DEFAULT_LOOKUP_TIMEOUT
from lmcache_async.rpc.lookup.endpoint import DEFAULT_LOOKUP_LIMITS, LookupId, lookup_endpoint
from lmcache_async.rpc.lookup.server import DEFAULT_MAX_CONCURRENCY, LookupServer
from lmcache_async.rpc.lookup.sync_client import SyncLookupClient

__all__ = [
    "DEFAULT_LOOKUP_LIMITS",
    "DEFAULT_LOOKUP_TIMEOUT",
    "DEFAULT_MAX_CONCURRENCY",
    "LookupClient",
    "LookupId",
    "LookupServer",
    "SyncLookupClient",
    "lookup_endpoint",
]
