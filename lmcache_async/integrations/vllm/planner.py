"""The scheduler side of the connector: which tokens each step loads and stores.

vLLM's scheduler asks :meth:`SchedulerPlanner.num_new_matched_tokens` how many tokens of a
prompt the workers can load; the planner looks the prompt up on every worker (pinning the
hit under the request id) and offers the cached tokens beyond vLLM's own prefix cache, at
most the prompt length minus 1 so vLLM computes at least one token itself.
:meth:`~SchedulerPlanner.after_alloc` keeps the load vLLM accepted, and
:meth:`~SchedulerPlanner.build` turns each scheduled step into the workers' orders
(:class:`~.metadata.LMCacheAsyncConnectorMetadata`): the accepted loads, and the whole
prompt chunks the step computes (the short last chunk too, with ``save_unfull_chunk``).

Each request's tenant is its ``cache_salt`` (vLLM's per-request salt of its own prefix
cache), else the connector's ``tenant``: it keys the request's lookups, loads and stores,
so requests of different tenants never share cached KV. A request whose salt cannot be a
tenant name (:func:`~lmcache_async.tenants.check_tenant`) is neither loaded nor stored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from lmcache_async.config import EngineConfig
from lmcache_async.errors import InvalidInputError
from lmcache_async.rpc.lookup import SyncLookupClient
from lmcache_async.tenants import check_tenant

from .metadata import LMCacheAsyncConnectorMetadata, LoadSpec, SaveSpec

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

__all__ = ["SchedulerPlanner"]

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Pending:
    """A hit offered to vLLM and not yet sent to the workers."""

    key_end: int  # tokens keying the chunks to read
    start: int  # vLLM's own computed tokens
    end: int  # one past the last token to load
    hit: int  # cached prefix tokens found by the lookup


@dataclass(slots=True)
class _Tracker:
    """A running request as the scheduler side sees it."""

    prompt: list[int]
    block_ids: list[int]
    saved: int  # prompt tokens [0, saved) are cached or handed to a store
    computed: int  # tokens whose KV exists once the last scheduled step ran
    tenant: str | None = None
    epoch: int = 0
    load_end: int = 0
    external: int = 0
    failed: int = 0
    stored: int = 0


class SchedulerPlanner:
    """The scheduler side's bookkeeping: which tokens to load and store, step by step.

    It reads only plain attributes of vLLM's scheduler output, so it can be driven by
    tests without a running vLLM. ``lookup(tokens, req_id, tenant)`` returns the cached
    prefix tokens of ``tenant`` (pinning them under ``req_id``); ``unpin(req_id)`` releases
    such pins. ``default_tenant``: the tenant of a request without a ``cache_salt``.

    ``load_granule``: a load ends on a multiple of it (1: any token). Every KV layout the
    connector accepts moves single tokens exactly (vLLM's CPU packings included), so the
    connector loads up to the token vLLM must compute itself.
    """

    def __init__(
        self,
        *,
        chunk_size: int,
        save_unfull_chunk: bool,
        lookup: Callable[[list[int], str, str | None], int],
        unpin: Callable[[str], None],
        can_load: bool = True,
        can_save: bool = True,
        load_granule: int = 1,
        default_tenant: str | None = None,
    ) -> None:
        self._chunk = chunk_size
        self._default_tenant = check_tenant(default_tenant, field="default_tenant")
        self._granule = load_granule
        self._save_unfull = save_unfull_chunk
        self._lookup = lookup
        self._unpin = unpin
        self._can_load = can_load
        self._can_save = can_save
        self._pending: dict[str, _Pending] = {}
        self._loads: dict[str, _Pending] = {}
        self._trackers: dict[str, _Tracker] = {}
        # The tenant of each request seen and not finished (None: the workers' own), and
        # the requests whose salt cannot be a tenant name (never cached).
        self._tenants: dict[str, str | None] = {}
        self._refused: set[str] = set()

    @classmethod
    def over_lookups(
        cls,
        client: SyncLookupClient,
        config: EngineConfig,
        *,
        can_load: bool = True,
        can_save: bool = True,
        default_tenant: str | None = None,
    ) -> SchedulerPlanner:
        """A planner of ``config``'s chunks that looks prompts up on the workers through
        ``client`` (for the request's tenant), pinning each hit under the request id."""
        return cls(
            chunk_size=config.chunk_size,
            save_unfull_chunk=config.save_unfull_chunk,
            lookup=lambda tokens, req_id, tenant: client.lookup(
                tokens, lookup_id=req_id, pin=True, tenant=tenant
            ),
            unpin=client.unpin,
            can_load=can_load,
            can_save=can_save,
            load_granule=1,
            default_tenant=default_tenant,
        )

    def _note_tenant(self, req_id: str, cache_salt: str | None) -> bool:
        """Remember the tenant of ``req_id`` (its ``cache_salt``, else the default); False
        when the salt cannot be a tenant name: the request is then never cached (logged
        once)."""
        if req_id in self._refused:
            return False
        if req_id in self._tenants:
            return True
        if cache_salt is None:
            self._tenants[req_id] = self._default_tenant
            return True
        try:
            self._tenants[req_id] = check_tenant(cache_salt, field="cache_salt")
        except InvalidInputError as exc:
            log.warning("vllm_cache_salt_refused", req_id=req_id, reason=str(exc))
            self._refused.add(req_id)
            return False
        return True

    def _align(self, tokens: int) -> int:
        return tokens - tokens % self._chunk

    def num_new_matched_tokens(
        self,
        req_id: str,
        prompt: Sequence[int] | None,
        num_computed: int,
        cache_salt: str | None = None,
    ) -> int:
        """Tokens beyond ``num_computed`` the workers can load for this prompt (may be 0),
        cached for the request's tenant (``cache_salt``, else the default tenant)."""
        cacheable = self._note_tenant(req_id, cache_salt)
        if not cacheable or not self._can_load or prompt is None or len(prompt) < 2:
            return 0
        hit = self._lookup(list(prompt), req_id, self._tenants[req_id])
        length = len(prompt)
        if hit >= length:
            # The whole prompt is cached: load all but its last token, which vLLM computes.
            key_end, end = length, length - 1
        else:
            key_end = end = self._align(hit)
        end -= end % self._granule
        # Read no chunk that holds nothing to load.
        key_end = min(key_end, end + (-end) % self._chunk)
        if end <= num_computed:
            self._pending.pop(req_id, None)
            if hit:
                self._unpin(req_id)
            return 0
        self._pending[req_id] = _Pending(key_end=key_end, start=num_computed, end=end, hit=hit)
        return end - num_computed

    def after_alloc(
        self, req_id: str, num_external_tokens: int, cache_salt: str | None = None
    ) -> None:
        """vLLM allocated blocks and accepted ``num_external_tokens`` of the offer (of the
        request with ``cache_salt``)."""
        self._note_tenant(req_id, cache_salt)
        pending = self._pending.pop(req_id, None)
        if pending is None:
            return
        if num_external_tokens <= 0:
            if pending.hit:
                self._unpin(req_id)
            return
        pending.end = min(pending.end, pending.start + num_external_tokens)
        self._loads[req_id] = pending

    def build(self, output: SchedulerOutput) -> LMCacheAsyncConnectorMetadata:
        """The workers' orders for the step vLLM just scheduled."""
        meta = LMCacheAsyncConnectorMetadata()
        scheduled = output.num_scheduled_tokens
        for req_id in output.finished_req_ids:
            self._trackers.pop(req_id, None)
        for new in output.scheduled_new_reqs:
            if new.prompt_token_ids is None or new.req_id in self._refused:
                continue
            tracker = _Tracker(
                prompt=list(new.prompt_token_ids),
                block_ids=list(new.block_ids[0]) if new.block_ids else [],
                saved=0,
                computed=new.num_computed_tokens + scheduled.get(new.req_id, 0),
                tenant=self._tenants.get(new.req_id, self._default_tenant),
            )
            self._trackers[new.req_id] = tracker
            self._plan_load(new.req_id, tracker, meta)
            self._plan_save(new.req_id, tracker, meta)
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            running = self._trackers.get(req_id)
            if running is None:
                continue
            tracker = running
            new_blocks = cached.new_block_ids[i]
            num_computed = cached.num_computed_tokens[i]
            if req_id in cached.resumed_req_ids:
                # Preempted and scheduled again: a fresh block table, a new epoch.
                tracker.block_ids = list(new_blocks[0]) if new_blocks else []
                tracker.epoch += 1
                tracker.load_end = 0
            else:
                if new_blocks:
                    tracker.block_ids.extend(new_blocks[0])
                if num_computed < tracker.computed:
                    # vLLM rolled the request back: a load failed and is being recomputed.
                    tracker.epoch += 1
                    if tracker.load_end > num_computed:
                        tracker.failed += tracker.load_end - num_computed
                        tracker.load_end = num_computed
                    tracker.saved = min(tracker.saved, self._align(num_computed))
            tracker.computed = num_computed + scheduled.get(req_id, 0)
            self._plan_load(req_id, tracker, meta)
            self._plan_save(req_id, tracker, meta)
        return meta

    def _plan_load(
        self, req_id: str, tracker: _Tracker, meta: LMCacheAsyncConnectorMetadata
    ) -> None:
        load = self._loads.pop(req_id, None)
        if load is None:
            return
        meta.loads.append(
            LoadSpec(
                req_id=req_id,
                tokens=tracker.prompt[: load.key_end],
                block_ids=list(tracker.block_ids),
                start=load.start,
                end=load.end,
                epoch=tracker.epoch,
                tenant=tracker.tenant,
            )
        )
        tracker.load_end = load.end
        tracker.external += load.end - load.start
        # What the cache holds needs no store (a failed load rolls this back).
        cached = load.hit if load.hit >= len(tracker.prompt) else self._align(load.hit)
        tracker.saved = max(tracker.saved, cached)

    def _plan_save(
        self, req_id: str, tracker: _Tracker, meta: LMCacheAsyncConnectorMetadata
    ) -> None:
        if not self._can_save:
            return
        length = len(tracker.prompt)
        if tracker.saved >= length:
            return
        done = min(tracker.computed, length)
        end = done if done == length and self._save_unfull else self._align(done)
        if end <= tracker.saved:
            return
        meta.saves.append(
            SaveSpec(
                req_id=req_id,
                tokens=tracker.prompt[:end],
                block_ids=list(tracker.block_ids),
                start=tracker.saved,
                epoch=tracker.epoch,
                tenant=tracker.tenant,
            )
        )
        tracker.stored += end - tracker.saved
        tracker.saved = end

    def finished(self, req_id: str) -> dict[str, int] | None:
        """Forget a finished request; returns its token counts if it was tracked."""
        self._tenants.pop(req_id, None)
        self._refused.discard(req_id)
        pending = self._pending.pop(req_id, None) or self._loads.pop(req_id, None)
        self._loads.pop(req_id, None)
        if pending is not None and pending.hit:
            self._unpin(req_id)
        tracker = self._trackers.pop(req_id, None)
        if tracker is None:
            return None
        return {
            "external_tokens": tracker.external,
            "loaded_tokens": tracker.external - tracker.failed,
            "failed_tokens": tracker.failed,
            "stored_tokens": tracker.stored,
        }
