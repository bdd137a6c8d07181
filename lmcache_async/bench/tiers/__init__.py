"""Slow-tier benchmarks: each tier's put and get throughput next to a raw baseline of the
same bytes, measured in the same run.

- **disk** (:func:`bench_disk`): :class:`~lmcache_async.backends.disk.DiskBackend` ``put``
  and ``get`` of ``chunks`` chunks against plain files holding the same bytes in the same
  directory: ``open(path, "wb").write(...)`` per file and ``readinto`` a preallocated
  buffer, in one worker-thread call per batch, as the tier does. Reads come from the page
  cache for both sides (the files were just written) unless ``cold=True``, which syncs
  both sides' files and drops them from the page cache before reading.
- **redis** (:func:`bench_redis`): :class:`~lmcache_async.backends.redis.RedisBackend`
  ``put`` and ``get`` against plain redis-py (asyncio) pipelined ``SET`` / ``GET`` of the
  same records on the same server, ``call_bytes`` of values per call on both sides.

GB/s here is 10^9 bytes per second of payload; the median over ``repeats`` runs is
reported with every run's figures beside it. The two sides take turns batch by batch (a
batch through the tier, the same batch raw, and who goes first alternates), so background
write-back and other load on the machine weigh on both alike.

The package: :mod:`~.disk`, :mod:`~.redis`, what they share (:mod:`~.common`), the
scratch directory and local ``redis-server`` (:mod:`~.local`), and :mod:`~.run` (both, and
the text table); this module re-exports the public names.
"""

from __future__ import annotations

from lmcache_async.bench.tiers.disk import DISK_TARGETS, bench_disk
from lmcache_async.bench.tiers.redis import REDIS_TARGETS, bench_redis
from lmcache_async.bench.tiers.run import format_tiers, run_tiers_bench

__all__ = [
    "DISK_TARGETS",
    "REDIS_TARGETS",
    "bench_disk",
    "bench_redis",
    "format_tiers",
    "run_tiers_bench",
]
