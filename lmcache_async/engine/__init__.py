"""The embedded cache engine: :class:`CacheEngine`, the public face over its parts, and
the interface every client of the cache satisfies (:mod:`.client`: :class:`KVCacheClient`,
:class:`Promise`); :mod:`.distributed` shares one engine's KV across tensor-parallel ranks.

May import: ``pipelines``, ``core``, ``backends``, the data model and the ground floor.
Never ``rpc``, ``sync``, ``integrations``, ``cli`` or ``bench``.
"""

from __future__ import annotations

from .client import Promise
from .face import CacheEngine

__all__ = ["CacheEngine", "Promise"]
