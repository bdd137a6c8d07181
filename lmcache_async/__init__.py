"""lmcache_async: an asyncio-native KV-cache engine for LLM serving.

Store the KV cache a serving engine computed for a prompt, find how much of a new prompt's
prefix is cached, and load it back, through staged async pipelines over tiered storage.
"""

from __future__ import annotations

from .config import EngineConfig
from .engine import CacheEngine
from .engine.client import KVCacheClient, Promise
from .errors import (
    AllocationTimeoutError,
    ConfigError,
    EngineClosedError,
    IntegrityError,
    InvalidInputError,
    LMCacheAsyncError,
    PermissionDeniedError,
    ProtocolError,
    TierError,
    TierUnavailableError,
)
from .events import EventKind, KVEvent
from .keys import ChunkKey, HashAlgorithm
from .layouts import KVFormat, KVLayout, LayoutKind
from .rpc.client import RemoteCacheEngine
from .stats import EngineStats, PoolStats, TierStats
from .sync import SyncCacheEngine

__version__ = "0.1.0"

__all__ = [
    "AllocationTimeoutError",
    "CacheEngine",
    "ChunkKey",
    "ConfigError",
    "EngineClosedError",
    "EngineConfig",
    "EngineStats",
    "EventKind",
    "HashAlgorithm",
    "IntegrityError",
    "InvalidInputError",
    "KVCacheClient",
    "KVEvent",
    "KVFormat",
    "KVLayout",
    "LMCacheAsyncError",
    "PermissionDeniedError",
    "LayoutKind",
    "PoolStats",
    "Promise",
    "ProtocolError",
    "RemoteCacheEngine",
    "SyncCacheEngine",
    "TierError",
    "TierStats",
    "TierUnavailableError",
    "__version__",
]
