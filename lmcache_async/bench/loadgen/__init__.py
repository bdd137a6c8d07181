"""The async load generator behind ``lmcache-async bench``: a workload of requests against a
cache, on real KV tensors.

Each request does what a serving engine does with a prompt:

1. ``lookup`` the prompt, pinning the hit under a lookup id;
2. ``retrieve`` the cached prefix into paged KV memory (one tensor per layer, allocated
   once; each in-flight request owns a block range and maps a fresh block permutation of
   it, as a paged allocator would), or release the pin on a miss;
3. "compute" the rest: write the synthetic KV of the uncached tokens into their slots (the
   prefill; :class:`~lmcache_async.bench.workloads.KVSource`);
4. ``store`` the prompt, masking the chunks that came from the cache.

Every ``verify_every``-th retrieve is checked bit for bit (on a sample of its tokens)
against the KV the compute step would have written.

Targets: ``embedded`` (a :class:`~lmcache_async.CacheEngine` in this process),
``sidecar`` (a :class:`~lmcache_async.RemoteCacheEngine` connected to ``lmcache-async
serve``; its cache is left as it is at the end) and ``vllm``: vLLM's async engine on a local
model with the lmcache_async connector (:mod:`~lmcache_async.bench.vllm_target`; its cache
embedded in vLLM's worker, or the sidecar at ``url``). A vLLM request submits the prompt's
token ids and generates ``max_tokens`` tokens; the run times each request's first token
(``ttft``) and end (``request``) and counts the tokens the connector reports loaded and
stored; its hit rate is the loaded tokens over the prompt tokens.

Arrivals: with ``rate`` 0 (the default), ``concurrency`` requests are kept in flight
(closed loop); with a rate, requests arrive at that many per second (Poisson or evenly
spaced) and wait for a free slot when ``concurrency`` are already in flight; their
``request`` latency counts from the arrival. Results are plain data
(:func:`run_load`, also written as JSON); :func:`format_summary` renders them as text and
:func:`write_plot` draws latency and hit rate over the run.

The package, one concept per module: :mod:`~.options` (what to run), :mod:`~.targets`
(the embedded engine or a sidecar), :mod:`~.runner` (the steps of one request),
:mod:`~.tally` (what is counted), :mod:`~.driver` (the arrivals), :mod:`~.run` (a whole
run), :mod:`~.results` (the figures as plain data), :mod:`~.report` (the text summary) and
:mod:`~.plot` (the PNG). This module re-exports the public names.
"""

from __future__ import annotations

from lmcache_async.bench.loadgen.options import (
    ARRIVALS,
    OPERATIONS,
    TARGETS,
    VLLM_OPERATIONS,
    LoadOptions,
)
from lmcache_async.bench.loadgen.plot import check_plotting, write_plot
from lmcache_async.bench.loadgen.report import format_summary
from lmcache_async.bench.loadgen.run import run_load, run_load_async

__all__ = [
    "ARRIVALS",
    "OPERATIONS",
    "TARGETS",
    "VLLM_OPERATIONS",
    "LoadOptions",
    "check_plotting",
    "format_summary",
    "run_load",
    "run_load_async",
    "write_plot",
]
