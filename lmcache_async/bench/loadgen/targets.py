"""The caches a load run drives in KV tensors: an embedded engine or a sidecar.

Both are driven through :class:`~lmcache_async.KVCacheClient`; a :class:`Target` adds what
differs between them: where the chunk size comes from, and how their counters are read at
the end. (The ``vllm`` target runs whole requests in vLLM instead:
:mod:`~lmcache_async.bench.vllm_target`.)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from lmcache_async import (
    CacheEngine,
    EngineConfig,
    InvalidInputError,
    KVCacheClient,
    KVLayout,
    RemoteCacheEngine,
)
from lmcache_async.bench import plain_data
from lmcache_async.bench.loadgen.options import SIDECAR_TIMEOUT, LoadOptions

__all__ = ["SIDECAR_TIMEOUT", "Target", "open_target"]


@dataclass(slots=True)
class Target:
    """An open cache to drive, its chunk size and how to read its state at the end."""

    client: KVCacheClient
    chunk_size: int
    stats: Callable[[], Awaitable[dict[str, Any]]]
    """The target's counters as plain data."""
    finish: Callable[[], Awaitable[dict[str, Any]]]
    """What the target reports after the run (the embedded cache is cleared)."""


@contextlib.asynccontextmanager
async def open_target(
    options: LoadOptions, config: EngineConfig, layout: KVLayout
) -> AsyncIterator[Target]:
    """The target ``options`` name, open for the block: an embedded engine on ``config``
    (cleared at the end, by :attr:`Target.finish`), or the sidecar at ``options.url`` (left
    as it is).

    Raises:
        ConfigError: the embedded engine refuses the configuration.
        InvalidInputError: the sidecar serves another namespace, or did not say its chunk
            size.
        TierUnavailableError: the sidecar does not answer.
    """
    if options.target == "embedded":
        async with CacheEngine.open(config, layout, model_name=options.model_name) as engine:

            async def engine_stats() -> dict[str, Any]:
                data: dict[str, Any] = plain_data(engine.stats())
                return data

            async def clear() -> dict[str, Any]:
                removed = await engine.clear()
                return {
                    "cleared_chunks": removed,
                    "pool_used_bytes_after_clear": engine.stats().pool.used_bytes,
                }

            yield Target(engine, config.chunk_size, engine_stats, clear)
        return
    url = str(options.url)
    async with RemoteCacheEngine.connect(
        url,
        layout,
        model_name=options.model_name,
        timeout=options.sidecar_timeout,
        store_ahead=options.store_ahead,
    ) as remote:
        chunk_size = remote.chunk_size
        if chunk_size is None:  # connect() has said hello, so this is a broken server
            raise InvalidInputError(f"the sidecar at {url} did not say its chunk size")

        async def remote_stats() -> dict[str, Any]:
            snapshot = await remote.stats()
            data: dict[str, Any] = dict(snapshot.get("engine") or {})
            data["client"] = snapshot.get("client")
            data["server"] = snapshot.get("server")
            return data

        async def nothing() -> dict[str, Any]:
            return {}

        yield Target(remote, chunk_size, remote_stats, nothing)
