"""The worker side of the connector: each step, the metadata's orders carried out on the
worker's cache engine and vLLM's paged KV memory.

:class:`WorkerTransfers` loads (whole before the forward pass, layer by layer with
``use_layerwise``, or in the background between steps: :class:`~.loads.AsyncLoads`) and
stores (whole chunks after the forward pass, or layer by layer), each under the tenant of
its request. A load that brings fewer tokens than promised reports the blocks it did not
fill, which vLLM recomputes; the request's stores computed over a missing prefix in the
same step are dropped. A finished request whose blocks vLLM kept for a last store
(``store_decode_tokens``) is reported finished sending once that store is done or failed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.logging import get_logger
from lmcache_async.sync.engine import LayerSteps, SyncCacheEngine

from .kv_events import ConnectorEvents, WorkerEvents
from .loads import IDLE_STEP_WAIT, STUCK_GRACE, AsyncLoads, unfilled_blocks
from .metadata import LMCacheAsyncConnectorMetadata, LoadSpec, SaveSpec

__all__ = ["WorkerTransfers"]

log = get_logger(__name__)

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


class WorkerTransfers:
    """One worker's loads and stores, step by step, into the KV memory :meth:`attach`
    names. ``load_timeout``: seconds each asynchronous load may take."""

    def __init__(
        self, *, block_size: int, chunk_size: int, layerwise: bool, load_timeout: float
    ) -> None:
        self._block_size = block_size
        self._chunk = chunk_size
        self._layerwise = layerwise
        self._load_timeout = load_timeout
        self._engine: SyncCacheEngine | None = None
        self._kv_caches: list[torch.Tensor] = []
        self._layer_positions: dict[str, int] = {}
        self._async = AsyncLoads(block_size=block_size, chunk_size=chunk_size, timeout=load_timeout)
        self._layer_loads: list[_LayerLoad] = []
        self._layer_saves: list[_LayerSave] | None = None
        self._load_errors: set[int] = set()
        self._failed_epochs: dict[str, int] = {}
        self._released: set[str] = set()
        self.events: WorkerEvents | None = None
        """The worker's KV events for vLLM (set when vLLM publishes KV events)."""

    def attach(
        self,
        engine: SyncCacheEngine,
        kv_caches: list[torch.Tensor],
        layer_positions: dict[str, int],
    ) -> None:
        """Work on ``engine`` over ``kv_caches`` (in layer order; ``layer_positions``: each
        attention layer's name to its index)."""
        self._engine = engine
        self._kv_caches = kv_caches
        self._layer_positions = layer_positions

    @property
    def loads_in_flight(self) -> int:
        """Asynchronous loads started and not yet reported."""
        return len(self._async)

    def wait_for_loads(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the asynchronous loads started to be over;
        True when they are (the next :meth:`finished` reports them)."""
        return self._async.wait(timeout)

    # -- loads --------------------------------------------------------------------------------

    def start_loads(self, meta: LMCacheAsyncConnectorMetadata) -> None:
        """Start this step's loads: the synchronous ones are loaded before this returns
        (layerwise ones started: their lookup), the asynchronous ones started."""
        for load in meta.loads:
            if self._layerwise:
                self._start_layer_load(load)
            else:
                self._load(load)
        for load in meta.async_loads:
            self._async.start(self._engine, self._kv_caches, load)

    def _load(self, load: LoadSpec) -> None:
        engine = self._engine
        loaded: torch.Tensor | None = None
        try:
            if engine is None:
                raise InvalidInputError("KV caches were never registered")
            loaded = engine.retrieve(load.tokens, **self._retrieve_args(load))
        except Exception:
            self._load_failed(load)
        self._loaded(load, loaded)

    def _retrieve_args(self, load: LoadSpec) -> dict[str, Any]:
        return load.retrieve_args(
            self._kv_caches, block_size=self._block_size, chunk_size=self._chunk
        )

    def _load_failed(self, load: LoadSpec) -> None:
        log.exception("vllm_load_failed", req_id=load.req_id)
        if self._engine is not None:
            with contextlib.suppress(Exception):
                self._engine.lookup_unpin(load.req_id)

    def _loaded(self, load: LoadSpec, loaded: torch.Tensor | None) -> None:
        """Check a synchronous load (``loaded``: its mask, None if it failed); report the
        blocks it did not fill, so vLLM recomputes them, and void the request's stores
        of this epoch (computed over the missing prefix)."""
        bad = unfilled_blocks(load, loaded, self._block_size)
        if bad:
            self._load_errors |= bad
            self._failed_epochs[load.req_id] = load.epoch

    def _start_layer_load(self, load: LoadSpec) -> None:
        engine = self._engine
        steps: LayerSteps[torch.Tensor | None] | None = None
        try:
            if engine is None:
                raise InvalidInputError("KV caches were never registered")
            steps = engine.retrieve_layer(load.tokens, **self._retrieve_args(load))
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

    def wait_for_layer(self, layer_name: str) -> None:
        """Return once ``layer_name``'s KV of this step's layerwise loads is in the paged
        memory (the layers before it too)."""
        if not self._layer_loads:
            return
        position = self._layer_positions.get(layer_name)
        if position is None:
            return  # not a layer of ours: everything left is loaded by save()
        for layer_load in self._layer_loads:
            # Step 0 was the lookup; step i + 1 loads layer i.
            self._step_to(layer_load.steps, position + 2, layer_load.load.req_id)

    # -- stores -------------------------------------------------------------------------------

    def save_layer(self, layer_name: str, meta: LMCacheAsyncConnectorMetadata) -> None:
        """With ``use_layerwise``: copy ``layer_name``'s KV of this step's stores out (the
        chunks are put in :meth:`save`)."""
        if not self._layerwise:
            return
        position = self._layer_positions.get(layer_name)
        if position is None:
            return
        if self._layer_saves is None:
            self._layer_saves = self._start_layer_saves(meta)
        for layer_save in self._layer_saves:
            # Step i copies layer i out (step 0 also allocates the chunks' memory).
            self._step_to(layer_save.steps, position + 1, layer_save.save.req_id)

    def _start_layer_saves(self, meta: LMCacheAsyncConnectorMetadata) -> list[_LayerSave]:
        engine = self._engine
        if engine is None:
            return []
        started = self._each_save(meta.saves, engine.store_layer)
        return [_LayerSave(save, steps) for save, steps in started]

    def _each_save(
        self, saves: Sequence[SaveSpec], store: Callable[..., _R]
    ) -> list[tuple[SaveSpec, _R]]:
        """Call ``store`` (the engine's ``store`` or ``store_layer``) for each of ``saves``,
        skipping requests whose load failed; a failure is logged and that save left out."""
        done = []
        for save in saves:
            if self._failed_epochs.get(save.req_id) == save.epoch:
                continue  # computed over a prefix that failed to load
            self._learn_names(save)
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

    def _learn_names(self, save: SaveSpec) -> None:
        """Tell the KV events vLLM's names of the blocks ``save`` stores."""
        if self.events is None or not save.block_names or self._engine is None:
            return
        try:
            base = self._engine.engine.key_hasher
            self.events.learn(base, save.tokens, save.tenant, save.block_names)
        except Exception:  # the store goes on; its events keep our names
            log.exception("vllm_block_names_failed", req_id=save.req_id)

    def save(self, meta: LMCacheAsyncConnectorMetadata) -> None:
        """Store this step's chunks; returns once they are in host memory. With
        ``use_layerwise`` the layers were copied out in :meth:`save_layer`: the chunks are
        put here (dropped when the request's load failed this step). The finished
        requests whose blocks were kept for these stores are then released."""
        try:
            if self._layerwise:
                self._finish_layer_saves(meta)
            elif self._engine is not None:
                for save, stored in self._each_save(meta.saves, self._engine.store):
                    log.debug("vllm_kv_stored", req_id=save.req_id, start=save.start, tokens=stored)
        finally:
            self._released.update(meta.releases)

    def _finish_layer_saves(self, meta: LMCacheAsyncConnectorMetadata) -> None:
        self._finish_layer_loads()  # a load failing now voids the request's stores
        saves = self._layer_saves
        if saves is None:  # no attention layer ran with metadata: copy every layer now
            saves = self._start_layer_saves(meta)
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

    # -- reports ------------------------------------------------------------------------------

    def finished(
        self, finished_req_ids: set[str], *, idle: bool = False
    ) -> tuple[set[str] | None, set[str] | None]:
        """vLLM's ``get_finished``: the finished requests whose kept blocks were stored
        (finished sending) and the requests whose asynchronous loads are over (finished
        receiving; the blocks they did not fill are reported by :meth:`take_errors` in the
        same step). Forgets finished requests. ``idle``: the step computed nothing; it
        waits a moment (:data:`~.loads.IDLE_STEP_WAIT`) for a load under way first."""
        for req_id in finished_req_ids:
            self._failed_epochs.pop(req_id, None)
        if idle:
            self._async.wait_any(IDLE_STEP_WAIT)
        recving, bad = self._async.poll(finished_req_ids)
        self._load_errors |= bad
        sending, self._released = self._released, set()
        return sending or None, recving or None

    def take_events(self) -> ConnectorEvents | None:
        """The KV events since the last call, as vLLM's (None: none, or events are off)."""
        if self.events is None:
            return None
        try:
            return self.events.take(self._engine)
        except Exception:
            log.exception("vllm_kv_events_failed")
            return None

    def take_errors(self) -> set[int]:
        """Blocks whose load failed (this step's, and the asynchronous loads reported
        finished in it); vLLM recomputes them."""
        self._finish_layer_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        """Wait for the asynchronous loads under way (bounded), cancel those left; close
        the KV events' subscription."""
        self._async.close(self._load_timeout + STUCK_GRACE)
        if self.events is not None:
            self.events.close()
            self.events = None
