"""The scheduler side of the connector: which tokens each step loads and stores.

vLLM's scheduler asks :meth:`SchedulerPlanner.num_new_matched_tokens` how many tokens of a
prompt the workers can load. The planner asks every worker for a promise
(:class:`~lmcache_async.Promise`): the prompt prefix verified in host memory and pinned
under the request id. While a worker still brings disk or Redis hits into host memory the
promise is pending and vLLM is told to ask again (``None``); once ``prefetch_timeout`` has
passed since the first ask, the planner asks the workers to settle for what arrived. It
offers the promised tokens beyond vLLM's own prefix cache, at most the prompt length minus
1 so vLLM computes at least one token itself.

:meth:`~SchedulerPlanner.after_alloc` keeps the load vLLM accepted. An asynchronous load
(``load_async``: every load but layerwise ones) is sent to the workers with the next
step's orders, from the blocks vLLM allocated for it; vLLM schedules the request only once
the workers report it loaded, with the tokens that did load. A synchronous load is sent
with the step that schedules the request. :meth:`~SchedulerPlanner.build` turns each step
into the workers' orders (:class:`~.metadata.LMCacheAsyncConnectorMetadata`): the loads,
and the whole prompt chunks the step computes (the short last chunk too, with
``save_unfull_chunk``). With ``store_decode_tokens`` a finished request's generated tokens
are stored too (:meth:`~SchedulerPlanner.finish_save`).

Each request's tenant is its ``cache_salt`` (vLLM's per-request salt of its own prefix
cache), else the connector's ``tenant``: it keys the request's lookups, loads and stores,
so requests of different tenants never share cached KV. A request whose salt cannot be a
tenant name (:func:`~lmcache_async.tenancy.tenants.check_tenant`) is neither loaded nor stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmcache_async.config import EngineConfig
from lmcache_async.errors import InvalidInputError
from lmcache_async.logging import get_logger
from lmcache_async.rpc.lookup import SyncLookupClient
from lmcache_async.tenancy.tenants import check_tenant

from .kv_events import block_name
from .metadata import LMCacheAsyncConnectorMetadata, LoadSpec, SaveSpec
from .settings import DEFAULT_PREFETCH_TIMEOUT

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from lmcache_async.engine import Promise

__all__ = ["PromiseFn", "SchedulerPlanner"]

log = get_logger(__name__)

PromiseFn = Callable[[list[int], str, "str | None", int, bool], "Promise"]
"""``promise(tokens, req_id, tenant, computed_tokens, finish)``: the workers' promise for a
prompt (pinned under ``req_id``); ``finish`` settles a pending one for what arrived."""


@dataclass(slots=True)
class _Pending:
    """A hit offered to vLLM and not yet sent to the workers."""

    key_end: int  # tokens keying the chunks to read
    start: int  # vLLM's own computed tokens
    end: int  # one past the last token to load
    hit: int  # promised prefix tokens


@dataclass(slots=True)
class _Tracker:
    """A request as the scheduler side sees it, from its first load or step on."""

    prompt: list[int]
    block_ids: list[int]
    saved: int  # tokens [0, saved) are cached or handed to a store
    computed: int  # tokens whose KV exists once the last scheduled step ran
    tenant: str | None = None
    epoch: int = 0
    load_start: int = 0
    load_end: int = 0
    waiting: bool = False  # an asynchronous load was sent; vLLM has not scheduled it since
    external: int = 0
    failed: int = 0
    stored: int = 0


class SchedulerPlanner:
    """The scheduler side's bookkeeping: which tokens to load and store, step by step.

    It reads only plain attributes of vLLM's scheduler output, so it can be driven by
    tests without a running vLLM. ``promise`` (:data:`PromiseFn`) asks the workers for a
    promise of ``tenant``'s cached prefix, pinned under the request id; ``unpin(req_id)``
    releases such pins. ``default_tenant``: the tenant of a request without a
    ``cache_salt``. ``load_async``: loads run between steps (vLLM's asynchronous loads)
    rather than before the forward pass. ``prefetch_timeout``: seconds from the first ask
    after which a pending promise is settled (``clock`` tells the time).

    ``load_granule``: a load ends on a multiple of it (1: any token). Every KV layout the
    connector accepts moves single tokens exactly (vLLM's CPU packings included), so the
    connector loads up to the token vLLM must compute itself.
    """

    def __init__(
        self,
        *,
        chunk_size: int,
        save_unfull_chunk: bool,
        promise: PromiseFn,
        unpin: Callable[[str], None],
        can_load: bool = True,
        can_save: bool = True,
        load_granule: int = 1,
        default_tenant: str | None = None,
        load_async: bool = False,
        prefetch_timeout: float = DEFAULT_PREFETCH_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
        block_size: int = 0,
    ) -> None:
        self._chunk = chunk_size
        self._block_size = block_size
        self._default_tenant = check_tenant(default_tenant, field="default_tenant")
        self._granule = load_granule
        self._save_unfull = save_unfull_chunk
        self._promise = promise
        self._unpin = unpin
        self._can_load = can_load
        self._can_save = can_save
        self._load_async = load_async
        self._prefetch_timeout = prefetch_timeout
        self._clock = clock
        self._asked: dict[str, float] = {}  # when each request's promise was first asked
        self._holding: set[str] = set()  # may hold pins no load was sent for yet
        self._pending: dict[str, _Pending] = {}
        self._loads: dict[str, _Pending] = {}
        self._async_loads: list[LoadSpec] = []  # sent with the next step's orders
        self._final_saves: list[SaveSpec] = []  # likewise, of finished requests
        self._trackers: dict[str, _Tracker] = {}
        # The tenant of each request seen and not finished (None: the workers' own), and
        # the requests whose salt cannot be a tenant name (never cached).
        self._tenants: dict[str, str | None] = {}
        self._refused: set[str] = set()
        # vLLM's block hashes of each request noted (its own growing list), and not finished.
        self._block_hashes: dict[str, Sequence[bytes]] = {}

    @classmethod
    def over_lookups(
        cls,
        client: SyncLookupClient,
        config: EngineConfig,
        *,
        can_load: bool = True,
        can_save: bool = True,
        default_tenant: str | None = None,
        prefetch_timeout: float = DEFAULT_PREFETCH_TIMEOUT,
        block_size: int = 0,
        promise_wait: float = 0.0,
    ) -> SchedulerPlanner:
        """A planner of ``config``'s chunks that asks the workers for promises through
        ``client`` (for the request's tenant), pinned under the request id, each worker
        waiting up to ``promise_wait`` seconds for its reads before it answers pending; loads are
        asynchronous unless ``config.use_layerwise`` (those run in the forward pass)."""
        return cls(
            chunk_size=config.chunk_size,
            save_unfull_chunk=config.save_unfull_chunk,
            promise=lambda tokens, req_id, tenant, computed, finish: client.promise(
                tokens,
                lookup_id=req_id,
                tenant=tenant,
                computed_tokens=computed,
                finish=finish,
                wait=promise_wait,
            ),
            unpin=client.unpin,
            can_load=can_load,
            can_save=can_save,
            load_granule=1,
            default_tenant=default_tenant,
            load_async=not config.use_layerwise,
            prefetch_timeout=prefetch_timeout,
            block_size=block_size,
        )

    @property
    def load_async(self) -> bool:
        """Whether the loads offered run between steps (vLLM's asynchronous loads)."""
        return self._load_async

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

    def note_block_hashes(self, req_id: str, block_hashes: Sequence[bytes]) -> None:
        """vLLM's hashes of the request's blocks of ``block_size`` tokens (the request's own
        list, which grows as it computes): its stores name their blocks by them
        (:attr:`SaveSpec.block_names`). Nothing without a ``block_size``."""
        if self._block_size > 0:
            self._block_hashes[req_id] = block_hashes

    def _block_names(self, req_id: str, num_tokens: int) -> tuple[int, ...]:
        hashes = self._block_hashes.get(req_id)
        if hashes is None:
            return ()
        return tuple(block_name(h) for h in hashes[: num_tokens // self._block_size])

    def _align(self, tokens: int) -> int:
        return tokens - tokens % self._chunk

    def _release(self, req_id: str) -> None:
        """Release the pins a promise may hold for ``req_id`` and no load was sent for."""
        if req_id in self._holding:
            self._holding.discard(req_id)
            self._unpin(req_id)

    def num_new_matched_tokens(
        self,
        req_id: str,
        prompt: Sequence[int] | None,
        num_computed: int,
        cache_salt: str | None = None,
    ) -> int | None:
        """Tokens beyond ``num_computed`` the workers can load for this prompt (may be 0),
        cached for the request's tenant (``cache_salt``, else the default tenant); None
        while a worker is still bringing hits into host memory: ask again."""
        cacheable = self._note_tenant(req_id, cache_salt)
        if not cacheable or not self._can_load or prompt is None or len(prompt) < 2:
            return 0
        now = self._clock()
        finish = now - self._asked.setdefault(req_id, now) >= self._prefetch_timeout
        promise = self._promise(list(prompt), req_id, self._tenants[req_id], num_computed, finish)
        if promise.pending or promise.tokens:
            self._holding.add(req_id)
        if promise.pending and not finish:
            return None
        hit = promise.tokens
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
            self._release(req_id)
            return 0
        self._pending[req_id] = _Pending(key_end=key_end, start=num_computed, end=end, hit=hit)
        return end - num_computed

    def after_alloc(
        self,
        req_id: str,
        num_external_tokens: int,
        cache_salt: str | None = None,
        *,
        block_ids: Sequence[int] | None = None,
        prompt: Sequence[int] | None = None,
    ) -> None:
        """vLLM allocated blocks and accepted ``num_external_tokens`` of the offer (of the
        request with ``cache_salt``). An asynchronous load is planned here, into
        ``block_ids`` (the request's blocks, holding the tokens to load) of ``prompt``.

        Raises:
            InvalidInputError: an asynchronous load without ``block_ids`` or ``prompt``.
        """
        self._note_tenant(req_id, cache_salt)
        self._asked.pop(req_id, None)
        pending = self._pending.pop(req_id, None)
        if pending is None:
            return
        if num_external_tokens <= 0:
            self._release(req_id)
            return
        pending.end = min(pending.end, pending.start + num_external_tokens)
        if not self._load_async:
            self._loads[req_id] = pending
            return
        if block_ids is None or prompt is None:
            raise InvalidInputError("an asynchronous load needs the request's blocks and prompt")
        tracker = self._trackers.get(req_id)
        if tracker is None:
            tracker = _Tracker(
                prompt=list(prompt),
                block_ids=[],
                saved=0,
                computed=0,
                tenant=self._tenants.get(req_id, self._default_tenant),
            )
            self._trackers[req_id] = tracker
        elif tracker.waiting:
            # Its last load failed whole: vLLM freed the blocks and asked again.
            self._roll_back(tracker, pending.start)
        else:
            # Preempted, and loading again into a fresh block table.
            tracker.epoch += 1
        tracker.block_ids = list(block_ids)
        tracker.waiting = True
        self._async_loads.append(self._load_spec(req_id, tracker, pending))
        self._holding.discard(req_id)  # the load releases the pins

    def build(self, output: SchedulerOutput) -> LMCacheAsyncConnectorMetadata:
        """The workers' orders for the step vLLM just scheduled."""
        meta = LMCacheAsyncConnectorMetadata(
            async_loads=self._async_loads,
            saves=self._final_saves,
            releases=[save.req_id for save in self._final_saves],
            scheduled_tokens=output.total_num_scheduled_tokens,
        )
        self._async_loads, self._final_saves = [], []
        scheduled = output.num_scheduled_tokens
        for req_id in output.finished_req_ids:
            self._trackers.pop(req_id, None)
        for new in output.scheduled_new_reqs:
            if new.prompt_token_ids is None or new.req_id in self._refused:
                continue
            blocks = list(new.block_ids[0]) if new.block_ids else []
            tracker = self._trackers.get(new.req_id)
            if tracker is None:
                tracker = _Tracker(
                    prompt=list(new.prompt_token_ids),
                    block_ids=blocks,
                    saved=0,
                    computed=0,
                    tenant=self._tenants.get(new.req_id, self._default_tenant),
                )
                self._trackers[new.req_id] = tracker
            else:
                self._resumed(tracker, blocks, new.num_computed_tokens)
            tracker.computed = new.num_computed_tokens + scheduled.get(new.req_id, 0)
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
                self._resumed(tracker, list(new_blocks[0]) if new_blocks else [], num_computed)
            else:
                if new_blocks:
                    tracker.block_ids.extend(new_blocks[0])
                if num_computed < tracker.computed:
                    # vLLM rolled the request back: a load failed and is being recomputed.
                    self._roll_back(tracker, num_computed)
            tracker.computed = num_computed + scheduled.get(req_id, 0)
            self._plan_load(req_id, tracker, meta)
            self._plan_save(req_id, tracker, meta)
        return meta

    def _resumed(self, tracker: _Tracker, block_ids: list[int], num_computed: int) -> None:
        """A known request scheduled with a full block table: after its asynchronous load
        (``num_computed``: the tokens vLLM holds, fewer than loaded when the load failed),
        or resumed after a preemption (a new epoch)."""
        tracker.block_ids = block_ids
        if tracker.waiting:
            tracker.waiting = False
            if num_computed < tracker.load_end:
                self._roll_back(tracker, num_computed)
            return
        tracker.epoch += 1
        tracker.load_end = 0

    def _roll_back(self, tracker: _Tracker, num_computed: int) -> None:
        """vLLM holds only ``num_computed`` tokens of the request: what its load did not
        bring failed, and what the cache was thought to hold beyond them is stored again."""
        tracker.epoch += 1
        if tracker.load_end > num_computed:
            tracker.failed += tracker.load_end - max(num_computed, tracker.load_start)
            tracker.load_end = num_computed
        tracker.saved = min(tracker.saved, self._align(num_computed))

    def _load_spec(self, req_id: str, tracker: _Tracker, load: _Pending) -> LoadSpec:
        """The order for ``load`` into the tracker's blocks, counted as loaded."""
        tracker.load_start, tracker.load_end = load.start, load.end
        tracker.external += load.end - load.start
        # What the cache holds needs no store (a failed load rolls this back).
        cached = load.hit if load.hit >= len(tracker.prompt) else self._align(load.hit)
        tracker.saved = max(tracker.saved, cached)
        return LoadSpec(
            req_id=req_id,
            tokens=tracker.prompt[: load.key_end],
            block_ids=list(tracker.block_ids),
            start=load.start,
            end=load.end,
            epoch=tracker.epoch,
            tenant=tracker.tenant,
        )

    def _plan_load(
        self, req_id: str, tracker: _Tracker, meta: LMCacheAsyncConnectorMetadata
    ) -> None:
        load = self._loads.pop(req_id, None)
        if load is not None:
            meta.loads.append(self._load_spec(req_id, tracker, load))
            self._holding.discard(req_id)  # the load releases the pins

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
        meta.saves.append(self._save_spec(req_id, tracker, tracker.prompt[:end]))

    def _save_spec(self, req_id: str, tracker: _Tracker, tokens: list[int]) -> SaveSpec:
        """The order to store ``tokens`` beyond what the tracker saved, counted as stored."""
        save = SaveSpec(
            req_id=req_id,
            tokens=tokens,
            block_ids=list(tracker.block_ids),
            start=tracker.saved,
            epoch=tracker.epoch,
            tenant=tracker.tenant,
            block_names=self._block_names(req_id, len(tokens)),
        )
        tracker.stored += len(tokens) - tracker.saved
        tracker.saved = len(tokens)
        return save

    def finish_save(self, req_id: str, tokens: Sequence[int], block_ids: Sequence[int]) -> bool:
        """Plan, for the next step, a store of a finishing request's ``tokens`` (every token
        whose KV it computed, prompt and generated, held by ``block_ids``) beyond what was
        saved: whole chunks, and the short last one with ``save_unfull_chunk``. True when a
        store is planned: vLLM must keep the blocks until the workers report it done."""
        tracker = self._trackers.get(req_id)
        if tracker is None or tracker.waiting or not self._can_save:
            return False
        done = len(tokens)
        end = done if self._save_unfull else self._align(done)
        if end <= tracker.saved:
            return False
        tracker.block_ids = list(block_ids)
        self._final_saves.append(self._save_spec(req_id, tracker, list(tokens[:end])))
        return True

    def finished(self, req_id: str) -> dict[str, int] | None:
        """Forget a finished request; returns its token counts if it was tracked."""
        self._tenants.pop(req_id, None)
        self._block_hashes.pop(req_id, None)
        self._refused.discard(req_id)
        self._asked.pop(req_id, None)
        self._pending.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._release(req_id)
        tracker = self._trackers.pop(req_id, None)
        if tracker is None:
            return None
        return {
            "external_tokens": tracker.external,
            "loaded_tokens": tracker.external - tracker.failed,
            "failed_tokens": tracker.failed,
            "stored_tokens": tracker.stored,
        }
