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
:class:`~lmcache_async.sync.engine.SyncCacheEngine` over the paged KV memory vLLM hands it
and answers the scheduler's lookups over ZeroMQ (:mod:`lmcache_async.rpc.lookup`). Each step
the scheduler side tells the workers, through the connector metadata, what to load and
what to store:

1. ``get_num_new_matched_tokens`` asks every worker for a promise, pinned under the request
   id: the prompt prefix whose chunks are in host memory and verified. Hits only disk or
   Redis hold are first brought into host memory in the background (a prefetch, checksums
   verified); meanwhile the answer is ``None`` and vLLM asks again next step, up to
   ``prefetch_timeout``, after which what arrived is counted. Which hits are worth loading
   at all is the workers' cost model's choice (loading against recomputing at the prefill
   speed measured from vLLM's steps, or ``prefill_tokens_per_s``). It offers the promised
   tokens beyond vLLM's own prefix cache, at most the prompt length minus 1, so vLLM
   computes at least one token itself; a corrupt or missing chunk is never promised.
2. ``update_state_after_alloc`` keeps the load vLLM accepted. Loads are vLLM's asynchronous
   loads (``load_async``): ``build_connector_meta`` sends the load to the workers at once,
   into the blocks vLLM allocated for it, and vLLM leaves the request out of its steps
   until every worker reports it loaded, so the other requests keep running meanwhile.
3. ``start_load_kv`` (worker) starts each load in the background, bounded by
   ``load_timeout``; ``get_finished`` reports it once over. A load that comes back shorter
   than promised (a sidecar killed since the promise, a timeout) reports the blocks it did
   not fill (``get_block_ids_with_load_errors``, in the same step), so vLLM recomputes
   them: with its ``kv_load_failure_policy="recompute"``; under its default ``"fail"``
   such a request fails, which the connector warns of at start.
4. ``wait_for_save`` (worker) stores the whole chunks of the prompt whose KV this step
   computed (and the short last chunk once the prompt is done, when ``save_unfull_chunk``).
   A store returns once the chunks are in host memory; disk and Redis are written behind it.
   With ``store_decode_tokens`` a finished request's generated tokens are stored too, in
   the step after it finished (vLLM keeps its blocks until then).

Each request is cached as its tenant's: vLLM's per-request ``cache_salt``, else the
``tenant`` setting. The scheduler's lookups name it, the metadata carries it to the
workers, and it is bound into every chunk key, so one tenant's prompts never load another's
KV. Pipeline-parallel stages key their chunks under a model name of their own.

With ``use_layerwise: true`` the worker moves KV layer by layer, as vLLM's forward pass
reaches each attention layer, and loads are synchronous (in the forward pass):
``start_load_kv`` starts each load (looks its chunks up),
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
* :mod:`.worker` — the worker side: the orders carried out (:class:`WorkerTransfers`);
* :mod:`.loads` — the worker's asynchronous loads (:class:`AsyncLoads`);
* :mod:`.meter` — the prefill speed measured from vLLM's steps (:class:`PrefillMeter`);
* :mod:`.connector` — :class:`LMCacheAsyncConnector`: vLLM's entry points.
"""

from __future__ import annotations

from .connector import LMCacheAsyncConnector
from .layout import detect_layout, layer_order
from .loads import AsyncLoads
from .metadata import LMCacheAsyncConnectorMetadata, LoadSpec, SaveSpec, block_slots
from .meter import PrefillMeter, StepTimer
from .planner import SchedulerPlanner
from .settings import (
    CONNECTOR_KEYS,
    REQUEST_STATS_KEY,
    SIDECAR_ENGINE_KEYS,
    ConnectorSettings,
    load_failure_policy_warning,
)
from .worker import WorkerTransfers

__all__ = [
    "CONNECTOR_KEYS",
    "REQUEST_STATS_KEY",
    "SIDECAR_ENGINE_KEYS",
    "AsyncLoads",
    "ConnectorSettings",
    "LMCacheAsyncConnector",
    "LMCacheAsyncConnectorMetadata",
    "LoadSpec",
    "PrefillMeter",
    "SaveSpec",
    "SchedulerPlanner",
    "StepTimer",
    "WorkerTransfers",
    "block_slots",
    "detect_layout",
    "layer_order",
    "load_failure_policy_warning",
]
