"""The Redis tier at one size: a throwaway ``redis-server`` grown to N keys from size to
size, and an engine over it: its open, its first RAM hit and its requests.

The engine keeps no per-chunk index of Redis: a lookup asks the server (``EXISTS``), so
the tier's index bytes per chunk in the engine are none. With tenant quotas a per-tenant
index lives in the server itself (:mod:`lmcache_async.backends.redis_tenants`); this run
has no quotas. The server's own memory per key is reported beside it, record included.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import anyio.to_thread

from lmcache_async import CacheEngine
from lmcache_async.bench.scale.fill import fill_redis, redis_keys, remove_redis_keys
from lmcache_async.bench.scale.options import REQUEST_TOKENS
from lmcache_async.bench.scale.requests import MODEL_NAME, ScaleRun, prompt_stream, scale_config

__all__ = ["redis_at_size"]


async def redis_at_size(run: ScaleRun, size: int, url: str, filled: int) -> dict[str, Any]:
    """Every Redis figure at ``size`` keys: the server at ``url`` holds the first
    ``filled`` keys of the fill already (the probes' first), and is grown to ``size``."""
    from lmcache_async.backends.redis import DEFAULT_KEY_PREFIX  # noqa: PLC0415

    options, kit = run.options, run.kit
    problems: list[str] = []
    row: dict[str, Any] = {"chunks": size}
    fill = functools.partial(
        fill_redis,
        url,
        run.spec,
        run.probe_keys,
        filled,
        size - filled,
        key_prefix=DEFAULT_KEY_PREFIX,
        stream=run.stream,
        label=f"scale redis {size}: adding",
    )
    row["fill_keys_per_s"] = await anyio.to_thread.run_sync(fill)
    row["keys"] = await anyio.to_thread.run_sync(redis_keys, url)
    if row["keys"] != size:
        problems.append(f"redis {size}: the server holds {row['keys']} keys")
    row["server_bytes_per_key"] = await anyio.to_thread.run_sync(_memory_per_key, url)
    config = scale_config(run.base, remote_url=url)
    fresh = kit.prompts(prompt_stream(options.seed, "redis-fresh", size), options.probes)
    start = time.perf_counter()
    async with CacheEngine.open(config, kit.layout, model_name=MODEL_NAME) as engine:
        row["open_s"] = time.perf_counter() - start
        hit = await kit.first_hit(engine, run.first)
        row["first_hit_s"] = time.perf_counter() - start
        if hit != REQUEST_TOKENS:
            problems.append(f"redis {size}: the first lookup found {hit} of {REQUEST_TOKENS}")
        row["ops"], failed = await kit.measure(
            engine, fresh, run.probes, store_location=["redis"], warmup=options.warmup
        )
        problems += [f"redis {size}: {text}" for text in failed]
        stored = await kit.keys_of(engine, fresh)
    # The measured stores' keys go, so that the next size is grown from ``size`` keys.
    await anyio.to_thread.run_sync(
        functools.partial(remove_redis_keys, url, stored, key_prefix=DEFAULT_KEY_PREFIX)
    )
    row["index_bytes_per_chunk"] = 0.0
    row["index"] = "none (server side)"
    row["loadavg"] = os.getloadavg()
    row["problems"] = problems
    return row


def _memory_per_key(url: str) -> float:
    """The server's ``used_memory`` over its keys (records included)."""
    import redis  # noqa: PLC0415

    with redis.Redis.from_url(url, socket_timeout=60.0) as client:
        used = int(client.info("memory")["used_memory"])
        keys = int(client.dbsize())
    return used / keys if keys else 0.0
