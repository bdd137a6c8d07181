"""The sidecar's client: :class:`RemoteCacheEngine`, the engine interface over ZeroMQ.

A serving-engine worker opens it like an embedded engine::

    async with RemoteCacheEngine.connect(url, layout, model_name="m") as engine:
        stored = await engine.store(tokens, kv_caches=kv, slot_mapping=slots)
        mask = await engine.retrieve(tokens, kv_caches=kv, slot_mapping=slots)

The KV copies run here, in the caller's process, through the same transfer plans as an
embedded engine; only chunk keys and offsets cross the socket. On the server's host the
payloads are the server's own memory (a shared-memory segment mapped here); from another
host they travel as inline frames.

Every request has a timeout. When the sidecar is down, slow or restarting, ``store``
returns 0, ``retrieve`` an all-False mask and ``lookup`` 0 (the serving engine recomputes),
and a background task says hello again until it is back (a restarted sidecar has a new
segment, which is mapped afresh). Bad input still raises InvalidInputError. Concurrent
calls from many tasks share one DEALER socket: requests carry ids and one receive loop
hands each reply to its caller. The client needs the asyncio event loop.

Modules: :mod:`~.remote` (the engine front), :mod:`~.connection` (hellos, heartbeats,
reconnects), :mod:`~.link` (one socket: requests, replies, deadlines), :mod:`~.segment`
(the server's shared memory mapped here), :mod:`~.welcome` (the HELLO reply),
:mod:`~.settings` (the checked arguments and the HELLO), :mod:`~.wire` (key fields,
reply counts, refusals), and the calls by concern:
:mod:`~.transfers` (store, retrieve), :mod:`~.lookups`, :mod:`~.admin`, :mod:`~.moves`.
"""

from __future__ import annotations

from lmcache_async.rpc.client.moves import check_move_target
from lmcache_async.rpc.client.remote import RemoteCacheEngine
from lmcache_async.rpc.client.settings import (
    DEFAULT_CLIENT_LIMITS,
    DEFAULT_RECONNECT_INTERVAL,
    DEFAULT_TIMEOUT,
)

__all__ = [
    "DEFAULT_CLIENT_LIMITS",
    "DEFAULT_RECONNECT_INTERVAL",
    "DEFAULT_TIMEOUT",
    "RemoteCacheEngine",
    "check_move_target",
]
