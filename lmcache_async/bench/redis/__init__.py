"""Redis at the wire's speed (``lmcache-async bench --redis``): a request's chunks written
to and read from Redis by an embedded engine and through a sidecar, beside a plain socket
moving the same records; and a fresh engine's first store beside its steady state.

:mod:`~.wire` runs the Redis part against a real server with the plain socket of
:mod:`~.plain`, :mod:`~.first_store` the first-store part; :mod:`~.report` turns their
timings into medians and ratios (each the median of the rounds' own ratios) and text;
:mod:`~.run` runs both, on a ``redis-server`` started for the run unless given one;
:mod:`~.options` holds the settings and the goals.

May import: :mod:`lmcache_async.bench` and its sidecar and tier helpers, the package's
public API, config, errors, layouts and the Redis URL parser.
"""

from __future__ import annotations

from lmcache_async.bench.redis.options import GOALS, RedisBenchOptions
from lmcache_async.bench.redis.report import format_redis
from lmcache_async.bench.redis.run import run_redis_bench

__all__ = ["GOALS", "RedisBenchOptions", "format_redis", "run_redis_bench"]
