"""``LMCacheAsyncConnector``, the vLLM v1 KV connector; the protocol is drawn in
:mod:`lmcache_async.integrations.vllm`.

The scheduler-side methods hand over to :class:`~.planner.SchedulerPlanner`, the worker
side's orders to :class:`~.worker.WorkerTransfers`. Here: vLLM's entry points;
:meth:`~LMCacheAsyncConnector.register_kv_caches` recognises vLLM's KV memory
(:func:`~.layout.detect_layout`), opens a :class:`~lmcache_async.SyncCacheEngine` on it
(embedded, or a client of the sidecar) and serves the scheduler's lookups, telling them the
prefill speed measured from vLLM's steps (:mod:`.meter`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from lmcache_async.errors import InvalidInputError
from lmcache_async.logging import get_logger
from lmcache_async.rpc.curve import CurveClientKeys
from lmcache_async.rpc.lookup import SyncLookupClient
from lmcache_async.sync.engine import SyncCacheEngine

from .kv_events import ConnectorEvents, SidecarEvents, WorkerEvents
from .layout import detect_layout, layer_order
from .metadata import LMCacheAsyncConnectorMetadata
from .meter import CudaStepTimer, PrefillMeter, StepTimer
from .planner import SchedulerPlanner
from .settings import (
    REQUEST_STATS_KEY,
    ConnectorSettings,
    load_failure_policy_warning,
    open_engine,
)
from .worker import WorkerTransfers

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["LMCacheAsyncConnector"]

log = get_logger(__name__)


class LMCacheAsyncConnector(KVConnectorBase_V1):
    """vLLM's KV connector for lmcache_async; :mod:`lmcache_async.integrations.vllm` draws
    the protocol.

    Raises (at construction):
        ConfigError: an invalid ``kv_connector_extra_config``.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        settings = ConnectorSettings.from_extra_config(
            dict(transfer.kv_connector_extra_config or {})
        )
        self._settings = settings
        parallel = vllm_config.parallel_config
        self._tp_size = parallel.tensor_parallel_size
        self._pp_size = parallel.pipeline_parallel_size
        self._block_size = vllm_config.cache_config.block_size
        self._instance_id = settings.instance_id or _instance_id(vllm_config)
        self._layerwise = settings.engine.use_layerwise
        self._engine: SyncCacheEngine | None = None
        self._worker = WorkerTransfers(
            block_size=self._block_size,
            chunk_size=settings.engine.chunk_size,
            layerwise=self._layerwise,
            load_timeout=settings.load_timeout,
        )
        self._meter = PrefillMeter(
            min_tokens=settings.engine.chunk_size, fixed=settings.prefill_tokens_per_s
        )
        self._timer = StepTimer(self._meter)
        self._client: SyncLookupClient | None = None
        self._planner: SchedulerPlanner | None = None
        events_config = vllm_config.kv_events_config
        self._kv_events = events_config is not None and events_config.enable_kv_cache_events
        self._events: ConnectorEvents | None = None  # the workers' events, not yet taken
        if role == KVConnectorRole.SCHEDULER:
            client = SyncLookupClient(
                self._instance_id,
                self._tp_size * self._pp_size,
                socket_dir=settings.socket_dir,
                timeout=settings.lookup_timeout,
            )
            self._client = client
            self._planner = SchedulerPlanner.over_lookups(
                client,
                settings.engine,
                can_load=transfer.is_kv_consumer,
                can_save=transfer.is_kv_producer,
                default_tenant=settings.tenant,
                prefetch_timeout=settings.prefetch_timeout,
                block_size=self._block_size if self._kv_events else 0,
                promise_wait=settings.promise_wait,
            )
            # vLLM builds the scheduler's connector once per engine process.
            _warn_of_load_failure_policy(transfer.kv_load_failure_policy)
        log.info(
            "vllm_connector_created",
            role=role.name,
            instance_id=self._instance_id,
            chunk_size=settings.engine.chunk_size,
            sidecar=settings.sidecar_url,
            layerwise=self._layerwise,
        )

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Recognise vLLM's KV memory, open the cache engine on it (embedded, or a client
        of the sidecar) and serve lookups.

        Raises:
            InvalidInputError: a KV layout this connector does not know (naming it).
            ConfigError: the sidecar cuts chunks of another size than ``chunk_size``.
        """
        vllm_config = self._vllm_config
        model = vllm_config.model_config
        num_kv_heads, head_size = _heads(vllm_config, self._kv_cache_config)
        tp_rank, pp_rank = _ranks()
        names = list(kv_caches)
        order = layer_order(names)
        layout, tensors = detect_layout(
            [kv_caches[names[i]] for i in order],
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            use_mla=bool(getattr(model, "use_mla", False)),
            tp_world_size=self._tp_size,
            tp_rank=tp_rank,
        )
        if self._engine is not None:
            self._worker.close()
            self._engine.close()  # registered again: the old memory is gone
            self._engine = None
        engine = open_engine(
            self._settings,
            layout,
            model_name=_stage_model_name(str(model.model), pp_rank, self._pp_size),
            revision=model.revision,
            tenant=self._settings.tenant,
        )
        self._engine = engine
        positions = {names[i]: position for position, i in enumerate(order)}
        self._worker.attach(engine, tensors, positions)
        self._worker.events = self._worker_events()
        if tensors[0].is_cuda:
            self._timer = CudaStepTimer(self._meter, tensors[0].device)
        rank = pp_rank * self._tp_size + tp_rank
        endpoint = engine.serve_lookups(
            self._instance_id,
            rank,
            self._settings.socket_dir,
            prefill_speed=self._meter.tokens_per_s,
        )
        log.info(
            "vllm_kv_caches_registered",
            layout=layout.kind.value,
            fingerprint=layout.fingerprint,
            block_size=layout.block_size,
            layers=layout.num_layers,
            endpoint=endpoint,
            sidecar=self._settings.sidecar_url,
        )

    def _worker_events(self) -> WorkerEvents | None:
        """The worker's KV events for vLLM's stream, when vLLM publishes one: an embedded
        engine's own, or the sidecar's read from ``sidecar_events``."""
        settings = self._settings
        if not self._kv_events:
            return None
        sidecar = None
        if settings.sidecar_url is not None:
            if settings.sidecar_events is None:
                log.warning(
                    "vllm_sidecar_events_unset",
                    message="vLLM publishes KV events but sidecar_events is not set: the "
                    "sidecar's blocks are not among them",
                )
                return None
            curve = None
            if settings.sidecar_server_key is not None:
                curve = CurveClientKeys.make(
                    settings.sidecar_server_key, settings.sidecar_client_certificate
                )
            sidecar = SidecarEvents(settings.sidecar_events, curve=curve)
        elif not settings.engine.enable_kv_events:
            return None
        return WorkerEvents(
            block_size=self._block_size,
            chunk_size=settings.engine.chunk_size,
            tenants=settings.kv_events_tenants,
            sidecar=sidecar,
        )

    def get_kv_connector_kv_cache_events(self) -> ConnectorEvents | None:
        """This worker's KV events since the last step: the blocks the cache stored and
        removed, named as vLLM names them where known (:mod:`.kv_events`)."""
        return self._worker.take_events()

    def _orders(self) -> LMCacheAsyncConnectorMetadata | None:
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, LMCacheAsyncConnectorMetadata) else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """This step's orders; the step begins (its time is the prefill meter's)."""
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, LMCacheAsyncConnectorMetadata):
            self._timer.started(connector_metadata.scheduled_tokens)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads: the asynchronous ones in the background (reported by
        :meth:`get_finished`), the others loaded before returning, or with
        ``use_layerwise`` started (the lookup) and loaded in :meth:`wait_for_layer_load`."""
        meta = self._orders()
        if meta is None or not (meta.loads or meta.async_loads):
            return
        with self._timer.excluded():
            self._worker.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """With ``use_layerwise``: return once ``layer_name``'s KV of this step's loads is
        in the paged memory (the layers before it too). Otherwise loads finished in
        :meth:`start_load_kv` or run between steps."""
        if not self._layerwise:
            return
        with self._timer.excluded():
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """With ``use_layerwise``: copy ``layer_name``'s KV of this step's stores out (the
        chunks are put in :meth:`wait_for_save`). Otherwise nothing: whole chunks are
        stored in :meth:`wait_for_save`."""
        meta = self._orders() if self._layerwise else None
        if meta is None:
            return
        with self._timer.excluded():
            self._worker.save_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        """The forward pass is over (the step's time goes to the prefill meter): store
        this step's whole chunks; returns once they are in host memory. With
        ``use_layerwise`` the layers were copied out in :meth:`save_kv_layer`: the chunks
        are put here (dropped when the request's load failed this step)."""
        self._timer.ended()
        meta = self._orders()
        if meta is not None:
            self._worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished sending: the finished requests whose blocks were kept for a last store,
        now done. Finished receiving: the requests whose asynchronous loads are over (a
        step that computed nothing waits a few milliseconds for one first)."""
        meta = self._orders()
        idle = meta is not None and meta.scheduled_tokens == 0
        return self._worker.finished(finished_req_ids, idle=idle)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed (this step's, and those of the asynchronous loads
        :meth:`get_finished` reported in it); vLLM recomputes them."""
        return self._worker.take_errors()

    def shutdown(self) -> None:
        """Wait for the loads under way (bounded), then close the engine (queued disk/Redis
        writes are finished, bounded) or the client."""
        self._worker.close()
        if self._engine is not None:
            self._engine.close()
        if self._client is not None:
            self._client.close()

    # -- scheduler side -------------------------------------------------------------------

    def _scheduler(self) -> SchedulerPlanner:
        if self._planner is None:
            raise InvalidInputError("a scheduler-side method was called on a worker connector")
        return self._planner

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Promised tokens beyond vLLM's ``num_computed_tokens`` for the request's tenant
        (its ``cache_salt``, else the ``tenant`` setting), loaded asynchronously unless
        layerwise; None while the workers still bring hits into host memory."""
        planner = self._scheduler()
        if self._kv_events:
            planner.note_block_hashes(request.request_id, request.block_hashes)
        hits = planner.num_new_matched_tokens(
            request.request_id, request.prompt_token_ids, num_computed_tokens, request.cache_salt
        )
        if hits is None:
            return None, False
        return hits, hits > 0 and planner.load_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else None
        self._scheduler().after_alloc(
            request.request_id,
            num_external_tokens,
            request.cache_salt,
            block_ids=block_ids,
            prompt=request.prompt_token_ids,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Keep the workers' KV events for :meth:`take_events` (a failed load needs
        nothing here: it shows as vLLM rolling the request back)."""
        events = connector_output.kv_cache_events
        if not isinstance(events, ConnectorEvents):
            return
        if self._events is None:
            self._events = events
        else:
            self._events.add_events(events.get_all_events())
            self._events.increment_workers(events.get_number_of_workers())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The KV events every worker reported since the last call (vLLM publishes them
        with its own)."""
        events, self._events = self._events, None
        if events is None:
            return ()
        return events.aggregate().get_all_events()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Release what the request still holds. With ``store_decode_tokens`` its tokens
        beyond what was stored are stored in the next step: vLLM keeps its blocks until
        the workers report that done (True); otherwise they may be freed at once."""
        planner = self._scheduler()
        keep = False
        if self._settings.store_decode_tokens:
            computed = min(request.num_computed_tokens, len(block_ids) * self._block_size)
            keep = planner.finish_save(
                request.request_id, list(request.all_token_ids[:computed]), block_ids
            )
        counts = planner.finished(request.request_id)
        if self._settings.request_stats and counts is not None:
            return keep, {REQUEST_STATS_KEY: counts}
        return keep, None


def _warn_of_load_failure_policy(policy: str | None) -> None:
    """Warn when vLLM's ``kv_load_failure_policy`` fails a request on a failed load."""
    message = load_failure_policy_warning(policy)
    if message is not None:
        log.warning(
            "vllm_kv_load_failure_policy_fail",
            setting="kv_load_failure_policy",
            policy=policy,
            message=message,
        )


def _instance_id(vllm_config: VllmConfig) -> str:
    """Sockets are named after vLLM's engine id, plus the data-parallel rank."""
    engine_id = vllm_config.kv_transfer_config.engine_id if vllm_config.kv_transfer_config else None
    base = engine_id or "vllm"
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size > 1:
        return f"{base}-dp{parallel.data_parallel_rank}"
    return base


def _stage_model_name(model_name: str, pp_rank: int, pp_size: int) -> str:
    """The model name the chunk keys of pipeline stage ``pp_rank`` are bound to: stages hold
    different layers, maybe of one layout fingerprint, so each keys its chunks in a
    namespace of its own (the tenant stays the user's, for erasure by tenant)."""
    if pp_size <= 1:
        return model_name
    return f"{model_name}#pp{pp_rank}of{pp_size}"


def _heads(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> tuple[int, int]:
    """KV heads of this rank and head size, from the KV cache spec or the model config."""
    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        heads = getattr(spec, "num_kv_heads", None)
        size = getattr(spec, "head_size", None)
        if isinstance(heads, int) and isinstance(size, int):
            return heads, size
    model = vllm_config.model_config
    return model.get_num_kv_heads(vllm_config.parallel_config), model.get_head_size()


def _ranks() -> tuple[int, int]:
    """This worker's tensor- and pipeline-parallel ranks (0, 0 outside a vLLM group)."""
    try:
        return (
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pp_group().rank_in_group,
        )
    except (AssertionError, AttributeError):
        return 0, 0
