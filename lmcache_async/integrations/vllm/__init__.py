"""A vLLM v1 KV connector: ``LMCacheAsyncConnector``.

Load it with::

    KVTransferConfig(
        kv_connector="LMCacheAsyncConnector",
        kv_connector_module_path="lmcache_async.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"chunk_size": 256, "local_disk": "/var/cache/kv"},
    )

vLLM builds the connector twice: once in its scheduler (role ``SCHEDULER``) and once in
every worker (role ``WORKER``), usually in different processes. Each worker opens a
:class:`~lmcache_async.sync_engine.SyncCacheEngine` over the paged KV memory vLLM hands it
and answers the scheduler's lookups over ZeroMQ (:mod:`lmcache_async.rpc.lookup`). Each step
the scheduler side tells the workers, through the connector metadata, what to load before
the forward pass and what to store after it:

1. ``get_num_new_matched_tokens`` looks the prompt up on every worker, pinning the hit under
   the request id, and offers vLLM the cached tokens beyond its own prefix cache (at most
   the prompt length minus 1, so vLLM computes at least one token itself).
2. ``update_state_after_alloc`` keeps the load vLLM accepted; ``build_connector_meta`` sends
   it to the workers with the request's block ids.
3. ``start_load_kv`` (worker) retrieves into the paged memory before the forward pass. A
   load that comes back shorter than promised (a chunk failed its checksum or could not be
   read) reports the blocks it did not fill (``get_block_ids_with_load_errors``), so vLLM
   recomputes them; the request's stores of that step are dropped, since they were computed
   over the missing prefix.
4. ``wait_for_save`` (worker) stores the whole chunks of the prompt whose KV this step
   computed (and the short last chunk once the prompt is done, when ``save_unfull_chunk``).
   A store returns once the chunks are in host memory; disk and Redis are written behind it.

Each request is cached as its tenant's: vLLM's per-request ``cache_salt``, else the
``tenant`` setting. The scheduler's lookups name it, the metadata carries it to the
workers, and it is bound into every chunk key, so one tenant's prompts never load another's
KV. Pipeline-parallel stages key their chunks under a model name of their own.

With ``use_layerwise: true`` the worker moves KV layer by layer, as vLLM's forward pass
reaches each attention layer: ``start_load_kv`` starts each load (looks its chunks up),
``wait_for_layer_load`` loads the layer about to run, ``save_kv_layer`` copies out the layer
just computed and ``wait_for_save`` puts the stored chunks (embedded engine only).

With ``sidecar_url`` each worker keeps no cache of its own: it opens a client of the sidecar
(``lmcache-async serve``), so several vLLM instances on the host share one cache that
outlives them. The scheduler still asks the workers, which ask the sidecar. Every request
to the sidecar is bounded by ``sidecar_timeout``; a sidecar that is down or slow makes
loads and lookups misses and stores no-ops (vLLM recomputes), never a hang.

Configuration: ``kv_connector_extra_config`` holds :class:`~lmcache_async.config.EngineConfig`
fields plus the connector's own keys (:data:`CONNECTOR_KEYS`); ``LMCACHE_ASYNC_*``
environment variables and a YAML file (``config_file``) are merged as by
:meth:`EngineConfig.load`, the extra config winning.

The package, one concept a module:

* :mod:`.settings` — :class:`ConnectorSettings` and the engine they open;
* :mod:`.layout` — which KV layout vLLM's per-layer tensors are in (:func:`detect_layout`);
* :mod:`.metadata` — the orders the scheduler side sends the workers each step;
* :mod:`.planner` — the scheduler side's bookkeeping (:class:`SchedulerPlanner`);
* :mod:`.connector` — :class:`LMCacheAsyncConnector`: vLLM's entry points, the worker side.
"""

from __future__ import annotations

from .connector import LMCacheAsyncConnector
from .layout import detect_layout, layer_order
from .metadata import LMCacheAsyncConnectorMetadata, LoadSpec, SaveSpec, block_slots
from .planner import SchedulerPlanner
from .settings import CONNECTOR_KEYS, REQUEST_STATS_KEY, SIDECAR_ENGINE_KEYS, ConnectorSettings

__all__ = [
    "CONNECTOR_KEYS",
    "REQUEST_STATS_KEY",
    "SIDECAR_ENGINE_KEYS",
    "ConnectorSettings",
    "LMCacheAsyncConnector",
    "LMCacheAsyncConnectorMetadata",
    "LoadSpec",
    "SaveSpec",
    "SchedulerPlanner",
    "block_slots",
    "detect_layout",
    "layer_order",
]
