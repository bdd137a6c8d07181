"""``LMCacheAsyncConnector``, the vLLM v1 KV connector; the protocol is drawn in
:mod:`lmcache_async.integrations.vllm`.

The scheduler-side methods hand over to :class:`~.planner.SchedulerPlanner`. The worker
side is here: :meth:`~LMCacheAsyncConnector.register_kv_caches` recognises vLLM's KV memory
(:func:`~.layout.detect_layout`), opens a :class:`~lmcache_async.SyncCacheEngine` on it
(embedded, or a client of the sidecar) and serves the scheduler's lookups; each step it
carries out the metadata's orders: loads before the forward pass (whole, or layer by layer
with ``use_layerwise``) and stores after it, each under the tenant of its request (vLLM's
``cache_salt``, else the ``tenant`` setting).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import structlog
import torch
from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from lmcache_async.errors import InvalidInputError
from lmcache_async.rpc.lookup import SyncLookupClient
from lmcache_async.sync_engine import LayerSteps, SyncCacheEngine

from .layout import detect_layout, layer_order
from .metadata import LMCacheAsyncConnectorMetadata, LoadSpec, SaveSpec
from .planner import SchedulerPlanner
from .settings import REQUEST_STATS_KEY, ConnectorSettings, open_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["LMCacheAsyncConnector"]

log = structlog.get_logger(__name__)

_R = TypeVar("_R")


@dataclass(slots=True)
class _LayerLoad:
    """A layerwise load of this step, stepped once per attention layer."""

    load: LoadSpec
    steps: LayerSteps[torch.Tensor | None]


@dataclass(slots=True)
class _LayerSave:
    """A layerwise store of this step, stepped once per attention layer."""

    save: SaveSpec
    steps: LayerSteps[int | None]


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
        self._settings = ConnectorSettings.from_extra_config(
            dict(transfer.kv_connector_extra_config or {})
        )
        parallel = vllm_config.parallel_config
        self._tp_size = parallel.tensor_parallel_size
        self._pp_size = parallel.pipeline_parallel_size
        self._block_size = vllm_config.cache_config.block_size
        self._chunk = self._settings.engine.chunk_size
        self._instance_id = self._settings.instance_id or _instance_id(vllm_config)
        self._layerwise = self._settings.engine.use_layerwise
        self._engine: SyncCacheEngine | None = None
        self._kv_caches: list[torch.Tensor] = []
        self._layer_positions: dict[str, int] = {}
        self._layer_loads: list[_LayerLoad] = []
        self._layer_saves: list[_LayerSave] | None = None
        self._load_errors: set[int] = set()
        self._failed_epochs: dict[str, int] = {}
        self._client: SyncLookupClient | None = None
        self._planner: SchedulerPlanner | None = None
        if role == KVConnectorRole.SCHEDULER:
            client = SyncLookupClient(
                self._instance_id,
                self._tp_size * self._pp_size,
                socket_dir=self._settings.socket_dir,
                timeout=self._settings.lookup_timeout,
            )
            self._client = client
            self._planner = SchedulerPlanner.over_lookups(
                client,
                self._settings.engine,
                can_load=transfer.is_kv_consumer,
                can_save=transfer.is_kv_producer,
                default_tenant=self._settings.tenant,
            )
        log.info(
            "vllm_connector_created",
            role=role.name,
            instance_id=self._instance_id,
            chunk_size=self._settings.engine.chunk_size,
            sidecar=self._settings.sidecar_url,
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
            self._engine.close()  # registered again: the old memory is gone
            self._engine = None
        self._kv_caches = tensors
        self._layer_positions = {names[i]: position for position, i in enumerate(order)}
        engine = open_engine(
            self._settings,
            layout,
            model_name=_stage_model_name(str(model.model), pp_rank, self._pp_size),
            revision=model.revision,
            tenant=self._settings.tenant,
        )
        self._engine = engine
        rank = pp_rank * self._tp_size + tp_rank
        endpoint = engine.serve_lookups(self._instance_id, rank, self._settings.socket_dir)
        log.info(
            "vllm_kv_caches_registered",
            layout=layout.kind.value,
            fingerprint=layout.fingerprint,
            block_size=layout.block_size,
            layers=layout.num_layers,
            endpoint=endpoint,
            sidecar=self._settings.sidecar_url,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Retrieve this step's loads into the paged memory: whole, before returning; or,
        with ``use_layerwise``, start them (the lookup) and load each layer in
        :meth:`wait_for_layer_load`."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, LMCacheAsyncConnectorMetadata) or not meta.loads:
            return
        for load in meta.loads:
            if self._layerwise:
                self._start_layer_load(load)
            else:
                self._load(load)

    def _load(self, load: LoadSpec) -> None:
        engine = self._engine
        loaded: torch.Tensor | None = None
        try:
            if engine is None:
                raise InvalidInputError("KV caches were never registered")
            slots, mask = load.slots_and_mask(block_size=self._block_size, chunk_size=self._chunk)
            loaded = engine.retrieve(
                load.tokens,
                kv_caches=self._kv_caches,
                slot_mapping=slots,
                mask=mask,
                req_id=load.req_id,
                lookup_id=load.req_id,
                tenant=load.tenant,
            )
        except Exception:
            self._load_failed(load)
        self._loaded(load, loaded)

    def _load_failed(self, load: LoadSpec) -> None:
        log.exception("vllm_load_failed", req_id=load.req_id)
        if self._engine is not None:
            with contextlib.suppress(Exception):
                self._engine.lookup_unpin(load.req_id)

    def _loaded(self, load: LoadSpec, loaded: torch.Tensor | None) -> None:
        """Check a finished load (``loaded``: its mask, None if it failed); report the
        blocks it did not fill, so vLLM recomputes them."""
        filled = load.start
        if loaded is not None:
            missing = (~loaded[load.start : load.end]).nonzero()
            filled = load.end if missing.numel() == 0 else load.start + int(missing[0])
        if filled >= load.end:
            log.debug("vllm_kv_loaded", req_id=load.req_id, tokens=load.end - load.start)
            return
        bs = self._block_size
        bad = set(load.block_ids[filled // bs : (load.end - 1) // bs + 1])
        self._load_errors |= bad
        self._failed_epochs[load.req_id] = load.epoch
        log.warning(
            "vllm_kv_load_incomplete",
            req_id=load.req_id,
            promised=load.end - load.start,
            loaded=filled - load.start,
            blocks=len(bad),
        )

    # -- layerwise --------------------------------------------------------------------------

    def _start_layer_load(self, load: LoadSpec) -> None:
        engine = self._engine
        steps: LayerSteps[torch.Tensor | None] | None = None
        try:
            if engine is None:
                raise InvalidInputError("KV caches were never registered")
            slots, mask = load.slots_and_mask(block_size=self._block_size, chunk_size=self._chunk)
            steps = engine.retrieve_layer(
                load.tokens,
                kv_caches=self._kv_caches,
                slot_mapping=slots,
                mask=mask,
                req_id=load.req_id,
                lookup_id=load.req_id,
                tenant=load.tenant,
            )
            steps.step()  # the lookup: references on every layer of the cached chunks
        except Exception:
            self._load_failed(load)
            if steps is not None:
                with contextlib.suppress(Exception):
                    steps.close()
            self._loaded(load, None)
            return
        self._layer_loads.append(_LayerLoad(load, steps))

    def _step_to(self, steps: LayerSteps[Any], taken: int, req_id: str) -> bool:
        """Step ``steps`` until ``taken`` steps are taken (or none is left); False when a
        step failed (logged; the transfer is then over)."""
        try:
            while not steps.done and steps.taken < taken:
                steps.step()
        except Exception:
            log.exception("vllm_layerwise_step_failed", req_id=req_id)
            return False
        return True

    def _finish_layer_loads(self) -> None:
        """Load every layer left of this step's layerwise loads and check them."""
        pending, self._layer_loads = self._layer_loads, []
        for layer_load in pending:
            steps = layer_load.steps
            ok = self._step_to(steps, steps.total, layer_load.load.req_id)
            last = steps.finish() if ok else None
            self._loaded(layer_load.load, last if isinstance(last, torch.Tensor) else None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """With ``use_layerwise``: return once ``layer_name``'s KV of this step's loads is
        in the paged memory (the layers before it too). Otherwise loads finished in
        :meth:`start_load_kv`."""
        if not self._layer_loads:
            return
        position = self._layer_positions.get(layer_name)
        if position is None:
            return  # not a layer of ours: everything left is loaded by wait_for_save
        for layer_load in self._layer_loads:
            # Step 0 was the lookup; step i + 1 loads layer i.
            self._step_to(layer_load.steps, position + 2, layer_load.load.req_id)

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
        if not self._layerwise:
            return
        position = self._layer_positions.get(layer_name)
        if position is None:
            return
        if self._layer_saves is None:
            self._layer_saves = self._start_layer_saves()
        for layer_save in self._layer_saves:
            # Step i copies layer i out (step 0 also allocates the chunks' memory).
            self._step_to(layer_save.steps, position + 1, layer_save.save.req_id)

    def _start_layer_saves(self) -> list[_LayerSave]:
        engine = self._engine
        if engine is None:
            return []
        return [_LayerSave(save, steps) for save, steps in self._each_save(engine.store_layer)]

    def _each_save(self, store: Callable[..., _R]) -> list[tuple[SaveSpec, _R]]:
        """Call ``store`` (the engine's ``store`` or ``store_layer``) for each of this
        step's saves, skipping requests whose load failed; a failure is logged and that
        save left out."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, LMCacheAsyncConnectorMetadata):
            return []
        done = []
        for save in meta.saves:
            if self._failed_epochs.get(save.req_id) == save.epoch:
                continue  # computed over a prefix that failed to load
            try:
                slots, mask = save.slots_and_mask(
                    block_size=self._block_size, chunk_size=self._chunk
                )
                result = store(
                    save.tokens,
                    kv_caches=self._kv_caches,
                    slot_mapping=slots,
                    mask=mask,
                    req_id=save.req_id,
                    tenant=save.tenant,
                )
            except Exception:
                log.exception("vllm_store_failed", req_id=save.req_id)
                continue
            done.append((save, result))
        return done

    def wait_for_save(self) -> None:
        """Store this step's whole prompt chunks; returns once they are in host memory.
        With ``use_layerwise`` the layers were copied out in :meth:`save_kv_layer`: the
        chunks are put here (dropped when the request's load failed this step)."""
        if self._layerwise:
            self._finish_layer_saves()
            return
        engine = self._engine
        if engine is None:
            return
        for save, stored in self._each_save(engine.store):
            log.debug("vllm_kv_stored", req_id=save.req_id, start=save.start, tokens=stored)

    def _finish_layer_saves(self) -> None:
        self._finish_layer_loads()  # a load failing now voids the request's stores
        saves = self._layer_saves
        if saves is None:  # no attention layer ran with metadata: copy every layer now
            saves = self._start_layer_saves()
        self._layer_saves = None
        for layer_save in saves:
            save, steps = layer_save.save, layer_save.steps
            if self._failed_epochs.get(save.req_id) == save.epoch:
                with contextlib.suppress(Exception):
                    steps.close()
                continue
            if self._step_to(steps, steps.total, save.req_id):
                stored = steps.finish()
                log.debug("vllm_kv_stored", req_id=save.req_id, start=save.start, tokens=stored)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Loads and stores are synchronous: nothing finishes later. Forgets finished ids."""
        for req_id in finished_req_ids:
            self._failed_epochs.pop(req_id, None)
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed this step; vLLM recomputes them."""
        self._finish_layer_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Close the engine (queued disk/Redis writes are finished, bounded) or the client."""
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
        """Cached tokens beyond vLLM's ``num_computed_tokens`` for the request's tenant (its
        ``cache_salt``, else the ``tenant`` setting); always a synchronous load."""
        hits = self._scheduler().num_new_matched_tokens(
            request.request_id, request.prompt_token_ids, num_computed_tokens, request.cache_salt
        )
        return hits, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler().after_alloc(request.request_id, num_external_tokens, request.cache_salt)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Nothing to do: a failed load shows as vLLM rolling the request back."""

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Release what the request still holds; its blocks may be freed at once."""
        counts = self._scheduler().finished(request.request_id)
        if self._settings.request_stats and counts is not None:
            return False, {REQUEST_STATS_KEY: counts}
        return False, None


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
