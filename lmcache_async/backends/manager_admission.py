"""The storage manager's store admission: chunks held back from the slow tiers until
their prefix was seen ``store_threshold`` times, and written behind then
(:class:`~.admission.Admission` counts the sightings)."""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_async.keys.chunks import ChunkSpan
from lmcache_async.logging import get_logger

from ..stats import AdmissionStats
from .admission import Admission, Held, adjacent_runs
from .cpu import CPUBackend
from .tier_events import TierEvents
from .tiers import TierSet
from .writers import TierWriters

__all__ = ["HeldWrites"]

log = get_logger(__name__)


class HeldWrites:
    """The admission methods of :class:`~.manager.StorageManager` (its CPU tier, tiers,
    writers, KV events and admission)."""

    _cpu: CPUBackend
    _tiers: TierSet
    _writers: TierWriters
    _kv_events: TierEvents
    _admission: Admission | None
    _frozen: bool

    def _admitted_parts(
        self, admission: Admission, spans: Sequence[ChunkSpan], tiers: tuple[str, ...]
    ) -> list[tuple[int, int]]:
        """The runs of ``spans`` (index ranges) admitted to the slow ``tiers`` now; the
        others are held back. A chunk the CPU tier did not keep (a quota refused it)
        cannot wait there: it is admitted."""
        cpu = self._cpu
        return admission.admit_runs(spans, tiers, holdable=[span.key in cpu for span in spans])

    def sighted(self, keys: Sequence[bytes]) -> None:
        """A lookup saw a prompt's chunk ``keys`` (store admission counts it): chunks held
        back that now reach ``store_threshold`` are written behind to the slow tiers."""
        if self._admission is not None:
            due = self._admission.sighted(keys)
            if due:
                self.write_behind(due)

    def write_behind(self, held: Sequence[Held]) -> int:
        """Queue chunks held back from the slow tiers for them now, with the CPU tier's
        payloads (a chunk it no longer holds is skipped, and so is a tier that is down or
        whose queue is full); returns the chunks queued for some tier. Always queued, even
        with ``wait_for_slow_tiers``: a lookup does not wait for a write. Nothing is
        written when frozen."""
        if self._frozen or not held:
            return 0
        ordered = sorted(held, key=Held.order)
        objs = self._cpu.get_nowait([item.span.key for item in ordered])
        queued = 0
        try:
            for group in adjacent_runs(ordered, objs):
                spans = [item.span for item, _ in group]
                keys = [span.key for span in spans]
                payloads = [obj for _, obj in group]
                event_of = self._kv_events.stored(spans, None)
                took = False
                for tier in self._tiers.slow:
                    if tier.name in group[0][0].tiers and tier.healthy():
                        writer = self._writers[tier.name]
                        took = writer.submit(keys, payloads, event_of.to(tier.name)) or took
                queued += len(keys) if took else 0
        finally:
            for obj in objs:
                if obj is not None:
                    obj.unref()
        if self._admission is not None:
            self._admission.written_behind += queued
        log.debug("written_behind", chunks=queued, held=len(held))
        return queued

    def admission_stats(self) -> AdmissionStats:
        """Store admission's counts (``store_threshold`` 1: nothing held back)."""
        return AdmissionStats() if self._admission is None else self._admission.stats()
