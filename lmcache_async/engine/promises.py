"""Promises: how much of a prompt a serving engine may count on loading, verified first.

A scheduler asks :meth:`Promises.promise` how many prompt tokens it can load for a request
(its lookup id). Only chunks in host memory, pinned for the lookup id, are promised: the
CPU tier's at once; chunks only disk or Redis hold are first read into host memory by a
prefetch in the background (their checksums verified by the read, a chunk that fails is a
miss), and until it is done the answer is "pending": the scheduler asks again. Which of
the lower-tier hits are worth reading at all is the cost model's choice
(:class:`~.costs.LoadCosts`): the prefix whose load is estimated faster than recomputing it.
``finish`` (the scheduler's patience is over) stops the prefetch and promises what arrived.

A promise holds its pins until the load under the same lookup id, :meth:`forget` (the
lookup's pins released) or ``pin_timeout``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from lmcache_async.engine.client import Promise
from lmcache_async.logging import get_logger

from ..backends.manager import StorageManager
from ..core import LoadCore, Prefetch
from ..stats import Counters
from .lookups import Lookups

if TYPE_CHECKING:
    from .costs import LoadCosts, LoadDecision

__all__ = ["Promise", "Promises"]

log = get_logger(__name__)


@dataclass(eq=False, slots=True)
class _Promised:
    """A lookup id's promise under way, or given."""

    keys: list[bytes]
    ends: list[int]
    num_tokens: int
    deadline: float  # when its pins expire (pin_timeout), the entry with them
    pinned: int  # leading chunks pinned so far
    wanted: int = 0  # leading chunks the cost model chose to load
    prefetch: Prefetch | None = None
    final: Promise | None = None


class Promises:
    """The promises of one engine over its tiers, lookups and load core.

    ``costs``: the load-or-recompute model (None: every hit is worth loading);
    ``declined`` is told each slow tier it declined hits of (its figures get no real reads
    to correct them: the probe measures it again). ``token_bytes``: payload bytes per
    token, to weigh a run of chunks.
    """

    def __init__(
        self,
        manager: StorageManager,
        load: LoadCore,
        lookups: Lookups,
        counters: Counters,
        *,
        costs: LoadCosts | None,
        chunk_size: int,
        token_bytes: int,
        pin_timeout: float,
        layerwise: bool,
        declined: Callable[[str], object] | None = None,
    ) -> None:
        self._manager = manager
        self._load = load
        self._lookups = lookups
        self._counters = counters
        self._costs = costs
        self._chunk_size = chunk_size
        self._token_bytes = token_bytes
        self._pin_timeout = pin_timeout
        self._layerwise = layerwise
        self._declined = declined
        self._promised: dict[Hashable, _Promised] = {}

    async def promise(
        self,
        keys: Sequence[bytes],
        ends: list[int],
        num_tokens: int,
        *,
        lookup_id: Hashable,
        locations: tuple[str, ...] | None,
        computed_tokens: int,
        prefill_tokens_per_s: float | None,
        finish: bool,
        wait: float = 0.0,
    ) -> Promise:
        """The promise for a prompt's chunk ``keys`` under ``lookup_id`` (the first call
        starts it; later calls, with the same keys, follow it); a prefetch under way is
        waited for up to ``wait`` seconds before the answer is pending."""
        self._expire()
        entry = self._promised.get(lookup_id)
        if entry is not None and (entry.keys != list(keys) or self._spent(entry, lookup_id)):
            self.forget(lookup_id)  # another prompt under the id, or a stale promise
            entry = None
        if entry is None:
            if self._layerwise:
                # Layerwise entries are read by the retrieve itself: pinned, not prefetched.
                hits = await self._lookups.lookup(
                    keys, ends, num_tokens, lookup_id=lookup_id, pin=True, locations=locations
                )
                return Promise(hits, False)
            entry = _Promised(
                list(keys),
                ends,
                num_tokens,
                deadline=time.monotonic() + self._pin_timeout,
                pinned=0,
            )
            self._promised[lookup_id] = entry
            await self._begin(entry, lookup_id, locations, computed_tokens, prefill_tokens_per_s)
        if entry.final is not None:
            return entry.final
        prefetch = entry.prefetch
        if prefetch is not None and not prefetch.done.is_set() and not finish and wait > 0:
            with anyio.move_on_after(wait):
                await prefetch.done.wait()
        if prefetch is not None and not prefetch.done.is_set():
            if not finish:
                return Promise(self._tokens(entry, entry.pinned), True)
            prefetch.stop()
            self._counters.promises_cut_short += 1
            await prefetch.done.wait()  # stopping ends the reads at once; what came is pinned
        if prefetch is not None:
            entry.pinned = prefetch.chunks
        return self._settle(entry, str(lookup_id))

    async def _begin(
        self,
        entry: _Promised,
        lookup_id: Hashable,
        locations: tuple[str, ...] | None,
        computed_tokens: int,
        prefill_tokens_per_s: float | None,
    ) -> None:
        """Start ``entry``'s promise: the CPU tier's part pinned, the worthwhile rest
        prefetched (or the final answer when there is nothing to read)."""
        lookups, manager = self._lookups, self._manager
        keys, num_tokens = entry.keys, entry.num_tokens
        lookups.count_request(num_tokens)
        lookups.sight(keys)
        if not lookups.healthy():
            entry.final = Promise(0, False)
            lookups.count_tenant(keys, num_tokens, 0)
            return
        entry.pinned = lookups.pin_cpu(keys, lookup_id)
        if entry.pinned == len(keys) or not manager.reads_slow_tiers(locations):
            return
        runs = await manager.locate_prefix(keys, locations, cpu_hits=entry.pinned)
        worth = self._worth_loading(
            entry, runs, computed_tokens, prefill_tokens_per_s, req_id=str(lookup_id)
        )
        entry.wanted = worth
        # Chunks wholly within what the serving engine has are not read (nor loaded).
        skip = self._chunks_within(entry, computed_tokens, worth)
        if worth > max(entry.pinned, skip):
            entry.prefetch = self._load.prefetch(
                keys[:worth],
                locations,
                lookup_id,
                pinned=entry.pinned,
                skip=skip if skip > entry.pinned else 0,
            )

    def _worth_loading(
        self,
        entry: _Promised,
        runs: list[tuple[str, int]],
        computed_tokens: int,
        prefill_tokens_per_s: float | None,
        *,
        req_id: str | None,
    ) -> int:
        """How many leading chunks of ``runs`` (tier, chunks) are worth loading."""
        held = sum(count for _, count in runs)
        if self._costs is None or not held:
            return held
        from .costs import Run  # noqa: PLC0415  (costs imports the stats, not us)

        cost_runs: list[Run] = []
        at = 0
        for tier, count in runs:
            start = self._tokens(entry, at)
            at += count
            tokens = self._tokens(entry, at) - start
            cost_runs.append(Run(tier, tokens, tokens * self._token_bytes))
        decision = self._costs.decide(
            cost_runs,
            computed_tokens=computed_tokens,
            total_tokens=entry.num_tokens,
            prefill_tokens_per_s=prefill_tokens_per_s,
        )
        self._costs.record(decision)
        if self._declined is not None:
            for tier, tokens in decision.declined_by_tier.items():
                if tokens:
                    self._declined(tier)
        chunks = self._chunks_within(entry, decision.tokens, held)
        _log_decision(req_id, decision, chunks, held)
        return chunks

    def _spent(self, entry: _Promised, lookup_id: Hashable) -> bool:
        """Whether a given promise is stale: it pinned nothing (the chunks may be cached
        since: ask again afresh), or lost its pins (loaded, released or expired)."""
        if entry.final is None:
            return False
        return entry.pinned == 0 or not self._manager.holds_pins(lookup_id)

    def _settle(self, entry: _Promised, req_id: str | None) -> Promise:
        tokens = self._lookups.count_hits(entry.keys, entry.pinned, entry.ends, entry.num_tokens)
        entry.final = Promise(tokens, False)
        counters = self._counters
        counters.promises += 1
        counters.promised_tokens += tokens
        if entry.wanted > entry.pinned:
            counters.promise_shortfall_tokens += self._tokens(entry, entry.wanted) - tokens
        log.debug("promised", req_id=req_id, tokens=tokens, chunks=entry.pinned)
        return entry.final

    def _tokens(self, entry: _Promised, chunks: int) -> int:
        """Prompt tokens the leading ``chunks`` chunks cover."""
        if not chunks:
            return 0
        if entry.ends:
            return entry.ends[chunks - 1]
        return min(chunks * self._chunk_size, entry.num_tokens)

    def _chunks_within(self, entry: _Promised, tokens: int, held: int) -> int:
        """The leading chunks (at most ``held``) that end at or before token ``tokens``."""
        chunks = 0
        while chunks < held and self._tokens(entry, chunks + 1) <= tokens:
            chunks += 1
        return chunks

    def forget(self, lookup_id: Hashable) -> None:
        """Drop the promise of ``lookup_id`` and stop its prefetch (its pins are the
        caller's to release)."""
        entry = self._promised.pop(lookup_id, None)
        if entry is not None and entry.prefetch is not None:
            self._load.stop_prefetch(lookup_id)

    def _expire(self) -> None:
        """Forget promises whose pins have expired."""
        now = time.monotonic()
        for lookup_id in [i for i, e in self._promised.items() if e.deadline <= now]:
            self.forget(lookup_id)


def _log_decision(req_id: str | None, decision: LoadDecision, chunks: int, held: int) -> None:
    log.debug(
        "load_decision",
        req_id=req_id,
        hit_tokens=decision.hit_tokens,
        promised_tokens=decision.tokens,
        chunks=chunks,
        held_chunks=held,
        load_s=round(decision.load_seconds, 6),
        recompute_s=round(decision.recompute_seconds, 6),
        prefill_tokens_per_s=decision.prefill_tokens_per_s,
        by_tier=decision.by_tier,
    )
