"""The blocking facade: :class:`SyncCacheEngine` runs an engine, or a sidecar's client, on
a thread of its own for callers without an event loop (vLLM's connector methods).

:mod:`.engine` (the facade) and :mod:`.calls` (the calls it hands to that thread).

May import: everything below it (``rpc``, ``engine`` and the layers under them). Never
``integrations``, ``cli`` or ``bench``.
"""

from __future__ import annotations

from lmcache_async.sync.engine import DEFAULT_SIDECAR_TIMEOUT, LayerSteps, SyncCacheEngine

__all__ = ["DEFAULT_SIDECAR_TIMEOUT", "LayerSteps", "SyncCacheEngine"]
