"""``bench --redis`` in one run: a server (started for the run, or ``redis_url``), the
Redis part, the first-store part, and their figures."""

from __future__ import annotations

import shutil
import tempfile
from typing import Any, TextIO

from lmcache_async.bench.redis.first_store import measure_first_stores
from lmcache_async.bench.redis.options import GOALS, RedisBenchOptions
from lmcache_async.bench.redis.report import above_goals, summarise_first_stores, summarise_wire
from lmcache_async.bench.redis.wire import measure_wire
from lmcache_async.bench.tiers.local import local_redis
from lmcache_async.config import EngineConfig
from lmcache_async.errors import InvalidInputError

__all__ = ["run_redis_bench"]


async def run_redis_bench(
    options: RedisBenchOptions | None = None,
    config: EngineConfig | None = None,
    *,
    progress_stream: TextIO | None = None,
) -> dict[str, Any]:
    """Run both parts and return every figure as plain data: the settings, the sizes,
    ``wire`` (:func:`~.report.summarise_wire`, with ``record_bytes`` and ``bit_exact``),
    ``first_store`` (:func:`~.report.summarise_first_stores` under ``kinds``, and
    ``pool_bytes``), the ``goals``, ``above_goal`` and ``problems``.

    ``config`` holds the settings the benchmark does not fix (the hash, the codec,
    encryption); progress goes to ``progress_stream``.

    Raises:
        InvalidInputError: bad options, no ``redis-server`` to start, or a URL a plain
            socket cannot reach.
        ConfigError: the engine refuses the settings.
        TimeoutError: the sidecar did not answer in time, or a call took too long.
        TierError: the server answered a plain command with an error.
        OSError: the server cannot be reached.
    """
    from lmcache_async.backends.redis_conn import parse_remote_url  # noqa: PLC0415 (optional)

    options = options or RedisBenchOptions()
    options.validate()
    base = config or EngineConfig()
    with tempfile.TemporaryDirectory(prefix="lmcache-async-bench-redis-") as directory:
        if options.redis_url is not None:
            server = parse_remote_url(options.redis_url).display
            raw = await measure_wire(options, base, options.redis_url, directory, progress_stream)
        else:
            if shutil.which("redis-server") is None:
                raise InvalidInputError(
                    "--redis needs redis-server (make redis) or --redis-url of a server"
                )
            with local_redis(directory) as url:
                server = f"{url} (started for the run)"
                raw = await measure_wire(options, base, url, directory, progress_stream)
    first = await measure_first_stores(options, base, progress_stream)
    layout = options.layout()
    results: dict[str, Any] = {
        "options": options.as_dict(),
        "server": server,
        "model": {
            "layers": layout.num_layers,
            "kv_heads": layout.num_kv_heads,
            "head_size": layout.head_size,
            "dtype": str(layout.dtype).removeprefix("torch."),
            "token_bytes": layout.token_bytes,
        },
        "chunk_bytes": options.chunk_bytes,
        "request_bytes": options.request_bytes,
        "wire": {
            **summarise_wire(raw["times_s"]),
            "record_bytes": raw["record_bytes"],
            "bit_exact": raw["bit_exact"],
        },
        "first_store": {
            "pool_bytes": first["pool_bytes"],
            "kinds": summarise_first_stores(first["kinds"]),
            "plain": summarise_first_stores({"plain": first["plain"]})["plain"],
        },
        "goals": dict(GOALS),
        "problems": [*raw["problems"], *first["problems"]],
    }
    results["above_goal"] = above_goals(results)
    return results
