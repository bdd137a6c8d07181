"""KV-aware routing over two vLLM servers (``lmcache-async bench --routing``): what a
router gains from seeing the blocks our connector holds in host memory.

Two ``vllm serve`` (:mod:`~.server`), each with the connector and its own CPU tier, publish
their KV events (vLLM's GPU blocks beside our CPU tier's) to NVIDIA Dynamo's standalone
indexer (:mod:`~.indexer`). Requests repeat one of a few shared prefixes
(:mod:`~.workload`), more than one server holds; each is routed by one of three policies
(:mod:`~.policy`): round robin, the best match among vLLM's own blocks, the best match
among all tiers. Every policy runs on freshly started servers and indexer
(:mod:`~.bench`); :mod:`~.report` sums up each policy's hit rate and time to first token
beside round robin's. :mod:`~.options` holds the settings, :mod:`~.ports` free ports.

May import: :mod:`lmcache_async.bench` and its helpers, the package's config and errors;
vLLM, Dynamo and transformers only in the child processes or when a model is built.
"""

from __future__ import annotations

from lmcache_async.bench.routing.bench import run_routing_bench
from lmcache_async.bench.routing.options import POLICIES, RoutingOptions
from lmcache_async.bench.routing.report import format_routing

__all__ = ["POLICIES", "RoutingOptions", "format_routing", "run_routing_bench"]
