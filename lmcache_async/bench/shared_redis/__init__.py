"""Two hosts sharing the cache through one Redis (``lmcache-async bench --shared-redis``):
how fast a host that never saw a prompt answers it from what another host put in Redis,
next to that other host's own warm hit.

Each host is a sidecar (:mod:`~.sidecar`, ``lmcache-async serve --remote-url``) and a
``vllm serve`` with the connector (the routing benchmark's server, its prefix cache off);
:mod:`~.bench` runs the phases, :mod:`~.report` sums them up, :mod:`~.options` holds the
settings.

May import: :mod:`lmcache_async.bench` and its routing and tier helpers, the package's
config, errors and wire protocol (for a PING); vLLM only in the child processes.
"""

from __future__ import annotations

from lmcache_async.bench.shared_redis.bench import run_shared_redis_bench
from lmcache_async.bench.shared_redis.options import PHASES, SharedRedisOptions
from lmcache_async.bench.shared_redis.report import format_shared_redis

__all__ = ["PHASES", "SharedRedisOptions", "format_shared_redis", "run_shared_redis_bench"]
