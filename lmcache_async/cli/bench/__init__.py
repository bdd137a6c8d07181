"""``lmcache-async bench``: its flags, and which benchmark they run.

Without a mode flag it runs the load generator (:mod:`lmcache_async.bench.loadgen`);
``--trace`` (and ``--trace-generate``), ``--micro``, ``--tiers``, ``--sidecar``, ``--gpu``,
``--vllm-slow-tier``, ``--routing``, ``--shared-redis``, ``--scale`` and ``--redis`` run
the other benchmarks.
"""

from __future__ import annotations

from lmcache_async.cli.bench.flags import add_bench_parser
from lmcache_async.cli.bench.run import run_bench

__all__ = ["add_bench_parser", "run_bench"]
