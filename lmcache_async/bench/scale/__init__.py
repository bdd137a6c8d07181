"""How the tiers behave as they grow (``lmcache-async bench --scale``): open time and the
cost of one request at N chunks, for N of 10k, 50k and 200k by default.

Chunks are 4 KiB (256 tokens of a one-layer, one-head model,
:func:`~.options.scale_layout`), so that what grows is the number of chunks, not the bytes
copied. For each tier and size:

- *open*: :meth:`CacheEngine.open <lmcache_async.CacheEngine.open>` until it returns, and
  until a first lookup is answered from RAM (a prompt stored there right after the open):
  an open must not wait for what a slow tier holds. The disk tier also: the tier's own
  open until its index is complete (``wait_index``), first with no manifest (every header
  read), then with the manifest its clean close wrote, beside a names-only ``os.scandir``
  walk of the same directory (the least any index of it costs) and their ratio;
- *requests*: p50 (and p90, p99) of a store, a lookup and a retrieve of a 1024-token
  request: a fresh prompt stored into the tier, a prompt only that tier holds looked up
  and retrieved; and each operation's growth exponent between the smallest and the
  largest size, ``log(t_large / t_small) / log(N_large / N_small)`` (0: flat, 1: linear);
- *index bytes per chunk*: the CPU tier's index and objects beyond the payload
  (:func:`~lmcache_async.backends.footprint.measure_cpu_tier`), the disk index's
  (``index_stats().bytes_per_chunk``); none for Redis, which the engine keeps no index of;
- the load average (``os.getloadavg``) with each size.

The disk and Redis tiers are filled without the engine, with their own record encoder
(:mod:`~.fill`); disk directories are kept under ``work_dir`` for later runs. Redis is a
``redis-server`` started for the run and stopped after.

Modules: :mod:`~.options`, :mod:`~.requests` (the engine's requests and their timing),
:mod:`~.fill`, one per tier (:mod:`~.cpu`, :mod:`~.disk`, :mod:`~.redis`), :mod:`~.run`
(the whole run) and :mod:`~.report` (the text, the growth exponent).

May import: everything but the CLI.
"""

from __future__ import annotations

from lmcache_async.bench.scale.options import DEFAULT_SIZES, TIERS, ScaleOptions, parse_sizes
from lmcache_async.bench.scale.report import format_scale, growth_exponent
from lmcache_async.bench.scale.run import run_scale_bench

__all__ = [
    "DEFAULT_SIZES",
    "TIERS",
    "ScaleOptions",
    "format_scale",
    "growth_exponent",
    "parse_sizes",
    "run_scale_bench",
]
