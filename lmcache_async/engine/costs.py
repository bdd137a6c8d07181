"""Load or recompute: how much of a prompt's cached prefix is worth loading.

Loading a chunk from disk or Redis is not always faster than letting the serving engine
recompute it: a slow or far tier can take longer per token than a prefill. Per slow tier,
:class:`LoadCosts` keeps a model of a read call, ``seconds = latency + bytes / throughput``,
fit to the tier's recent reads (:meth:`LoadCosts.observe`: a least-squares line through
exponentially weighted ``(bytes, seconds)`` samples, so a miss, a single chunk and a
batch each inform the latency and the throughput). A tier not yet measured is assumed
worth loading, and the CPU tier (host memory) always is.

:meth:`LoadCosts.decide` is a pure function of a prompt's cached runs (:class:`Run`, one
per stretch one tier holds, in prefix order) and those estimates: it picks the chunk
boundary ``end`` that minimises the time to load ``[computed, end)`` plus the time to
recompute ``[end, total)`` at the serving engine's prefill speed, so a slow tier holding
a prefix's tail is cut where loading stops paying. Reads are estimated as the prefetch
makes them: chunks in batches of ``batch_chunks`` from the prompt's start, a call per
tier per batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from lmcache_async.keys.tokens import is_strict_int

from ..errors import InvalidInputError
from ..stats import LoadCostStats, TierSpeedStats

__all__ = [
    "CPU_TIER",
    "DEFAULT_BATCH_CHUNKS",
    "DEFAULT_DECAY",
    "LoadCosts",
    "LoadDecision",
    "Run",
    "TierSpeed",
]

CPU_TIER: Final = "cpu"
"""The tier in host memory: loading from it is always worth it."""

DEFAULT_BATCH_CHUNKS: Final = 8
"""Chunks per read call of a prefetch (the engine passes ``pipeline_batch_chunks``)."""

DEFAULT_DECAY: Final = 0.9
"""Weight kept by the older samples at each new one: the last ten or so reads count most."""

# Byte counts closer together than this (relative to their mean) cannot tell latency
# from throughput: the fit then keeps its last latency and puts the rest on the bytes.
_SPREAD: Final = 1e-3


@dataclass(frozen=True, slots=True)
class Run:
    """Consecutive leading chunks of a prompt, held by one tier."""

    tier: str
    """``"cpu"``, ``"disk"``, ``"redis"``, ..."""
    tokens: int
    """Tokens the run covers."""
    nbytes: int
    """Payload bytes of the run."""


@dataclass(frozen=True, slots=True)
class LoadDecision:
    """How much of a prompt's cached prefix to load, and why."""

    tokens: int
    """Prefix tokens (from token 0) worth loading: a run boundary, or the chunk boundary
    inside a run where loading stops paying."""
    hit_tokens: int
    """Prefix tokens cached."""
    load_seconds: float
    """Estimated time to load ``[computed_tokens, tokens)``."""
    recompute_seconds: float
    """Estimated time to recompute the same tokens (NaN when the prefill speed is
    unknown)."""
    prefill_tokens_per_s: float | None
    """The prefill speed the decision used; None: unknown (everything cached is loaded)."""
    by_tier: dict[str, int]
    """Tokens promised per tier (of ``[0, tokens)``)."""
    declined_by_tier: dict[str, int] = field(default_factory=dict)
    """Tokens cached but not promised, per tier (of ``[tokens, hit_tokens)``)."""


class TierSpeed:
    """One tier's read model, ``seconds = latency + bytes * per_byte`` per call, fit to
    exponentially weighted ``(bytes, seconds)`` samples (``decay``: weight the older ones
    keep at each new sample)."""

    __slots__ = (
        "_decay",
        "_nn",
        "_nt",
        "_sn",
        "_st",
        "_w",
        "latency",
        "per_byte",
        "samples",
    )

    def __init__(self, decay: float = DEFAULT_DECAY) -> None:
        self._decay = decay
        self._w = self._sn = self._st = self._nn = self._nt = 0.0
        self.samples = 0
        self.latency: float | None = None
        """Seconds per call; None before any sample."""
        self.per_byte: float | None = None
        """Seconds per payload byte; None before a sample with bytes."""

    def observe(self, nbytes: int, seconds: float) -> None:
        """Add one read call that returned ``nbytes`` in ``seconds``."""
        d, n, t = self._decay, float(nbytes), float(seconds)
        self._w = d * self._w + 1.0
        self._sn = d * self._sn + n
        self._st = d * self._st + t
        self._nn = d * self._nn + n * n
        self._nt = d * self._nt + n * t
        self.samples += 1
        self._fit()

    def _fit(self) -> None:
        w = self._w
        mean_n, mean_t = self._sn / w, self._st / w
        if mean_n <= 0.0:  # misses only: every second is latency
            self.latency = mean_t
            return
        var = self._nn / w - mean_n * mean_n
        cov = self._nt / w - mean_n * mean_t
        if var > (mean_n * _SPREAD) ** 2 and cov > 0.0:
            per_byte = cov / var
            latency = mean_t - per_byte * mean_n
            if latency < 0.0:  # the line crosses below zero: fit one through the origin
                latency, per_byte = 0.0, self._nt / self._nn
        else:
            latency = min(self.latency or 0.0, mean_t)
            per_byte = (mean_t - latency) / mean_n
        self.latency, self.per_byte = latency, per_byte

    def seconds(self, nbytes: float, calls: int) -> float:
        """Estimated time of ``calls`` read calls returning ``nbytes`` in all (0 before any
        sample: a tier not measured is assumed worth loading)."""
        return calls * (self.latency or 0.0) + nbytes * (self.per_byte or 0.0)

    def stats(self) -> TierSpeedStats:
        per_byte = self.per_byte
        throughput = None if per_byte is None else (math.inf if per_byte <= 0 else 1 / per_byte)
        return TierSpeedStats(
            throughput_bytes_per_s=throughput, latency_s=self.latency, samples=self.samples
        )


def _check_speed(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInputError(f"{name} must be a number or None, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise InvalidInputError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)


def _check_count(name: str, value: int) -> None:
    if not is_strict_int(value) or value < 0:
        raise InvalidInputError(f"{name} must be an int >= 0, got {value!r}")


class LoadCosts:
    """The read speeds of an engine's slow tiers and the load-or-recompute decision.

    ``tiers``: the engine's tier names (``"cpu"`` needs no measuring; an unnamed tier's
    reads are ignored). ``chunk_size``: tokens per chunk. ``prefill_tokens_per_s``: the
    serving engine's prefill speed when a decision is not given one (None: unknown).
    ``batch_chunks``: chunks per read call of a prefetch.

    Raises (constructor):
        InvalidInputError: ``chunk_size`` or ``batch_chunks`` is not an int >= 1, or
            ``prefill_tokens_per_s`` is not None or a finite number > 0.
    """

    def __init__(
        self,
        tiers: Sequence[str],
        *,
        chunk_size: int,
        prefill_tokens_per_s: float | None = None,
        batch_chunks: int = DEFAULT_BATCH_CHUNKS,
        decay: float = DEFAULT_DECAY,
    ) -> None:
        for name, value in (("chunk_size", chunk_size), ("batch_chunks", batch_chunks)):
            if not is_strict_int(value) or value < 1:
                raise InvalidInputError(f"{name} must be an int >= 1, got {value!r}")
        if not 0.0 < decay < 1.0:
            raise InvalidInputError(f"decay must be between 0 and 1, got {decay!r}")
        self._chunk = chunk_size
        self._batch = batch_chunks
        self._prefill = _check_speed("prefill_tokens_per_s", prefill_tokens_per_s)
        self._speeds = {name: TierSpeed(decay) for name in tiers if name != CPU_TIER}
        self._decisions = 0
        self._cut = 0
        self._promised: dict[str, int] = {}
        self._declined: dict[str, int] = {}
        self._last_prefill: float | None = None

    @property
    def tiers(self) -> tuple[str, ...]:
        """The slow tiers measured."""
        return tuple(self._speeds)

    def speed(self, tier: str) -> TierSpeed | None:
        """The read model of ``tier`` (None for the CPU tier or a tier not measured)."""
        return self._speeds.get(tier)

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        """One read call of ``tier`` returned ``nbytes`` payload bytes in ``seconds`` (the
        storage manager's read observer). A tier not measured here, or a sample that is
        not a count and a finite duration, is ignored: the read path never fails on it."""
        speed = self._speeds.get(tier)
        if speed is None or not is_strict_int(nbytes) or nbytes < 0:
            return
        if not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds < 0:
            return
        speed.observe(nbytes, seconds)

    def decide(
        self,
        runs: Sequence[Run],
        *,
        computed_tokens: int,
        total_tokens: int,
        prefill_tokens_per_s: float | None = None,
    ) -> LoadDecision:
        """The prefix of ``runs`` worth loading for a prompt of ``total_tokens`` whose first
        ``computed_tokens`` the serving engine has already.

        The answer ends at a chunk boundary: the leading CPU run (free), or a boundary
        past ``computed_tokens`` where loading ``[computed, end)`` and recomputing
        ``[end, total)`` takes least time (ties go to the longer prefix).
        ``prefill_tokens_per_s`` (else the constructor's; None: unknown) prices the
        recompute; unknown, everything cached is worth loading.

        Raises:
            InvalidInputError: a count below 0, or a prefill speed that is not a finite
                number > 0.
        """
        _check_count("computed_tokens", computed_tokens)
        _check_count("total_tokens", total_tokens)
        prefill = _check_speed("prefill_tokens_per_s", prefill_tokens_per_s)
        if prefill is None:
            prefill = self._prefill
        hit = 0
        for run in runs:
            _check_count("Run.tokens", run.tokens)
            _check_count("Run.nbytes", run.nbytes)
            hit += run.tokens
        total = max(total_tokens, hit)
        base = runs[0].tokens if runs and runs[0].tier == CPU_TIER else 0
        if prefill is None:
            end, load = hit, self._load_seconds(runs, computed_tokens, hit)
        else:
            end, load = self._best_end(runs, base, computed_tokens, total, prefill)
        saved = max(end - computed_tokens, 0)
        promised, declined = _split_by_tier(runs, end)
        return LoadDecision(
            tokens=end,
            hit_tokens=hit,
            load_seconds=load,
            recompute_seconds=math.nan if prefill is None else saved / prefill,
            prefill_tokens_per_s=prefill,
            by_tier=promised,
            declined_by_tier=declined,
        )

    def _best_end(
        self, runs: Sequence[Run], base: int, computed: int, total: int, prefill: float
    ) -> tuple[int, float]:
        """The end minimising load + recompute, and its load time: every chunk boundary
        past ``computed`` (and past the free CPU run) is weighed."""
        best_end = base
        best_load = 0.0
        best = (total - max(base, computed)) / prefill
        chunk = self._chunk
        floor = computed - computed % chunk  # a chunk that holds ``computed`` is read whole
        start = 0
        before = 0.0  # load time of the runs before this one, from ``floor`` on
        for run in runs:
            stop = start + run.tokens
            speed = self._speeds.get(run.tier)
            low = max(start, floor)
            edge = (start // chunk + 1) * chunk
            while start < stop:
                boundary = min(edge, stop)
                if boundary > max(base, computed):
                    load = before + self._piece(run, speed, low, boundary)
                    cost = load + (total - boundary) / prefill
                    if cost <= best:
                        best, best_end, best_load = cost, boundary, load
                if boundary == stop:
                    break
                edge += chunk
            before += self._piece(run, speed, low, stop)
            start = stop
        return best_end, best_load

    def _piece(self, run: Run, speed: TierSpeed | None, low: int, end: int) -> float:
        """Estimated time to read tokens ``[low, end)`` of ``run`` (prompt positions inside
        it), in the calls a prefetch's batches make."""
        if speed is None or end <= low or not run.tokens:
            return 0.0
        nbytes = run.nbytes * (end - low) / run.tokens
        chunk, batch = self._chunk, self._batch
        first, last = low // chunk, (end - 1) // chunk
        calls = last // batch - first // batch + 1
        return speed.seconds(nbytes, calls)

    def _load_seconds(self, runs: Sequence[Run], computed: int, end: int) -> float:
        """Estimated time to load ``[computed, end)`` of ``runs``."""
        floor = computed - computed % self._chunk
        start = 0
        total = 0.0
        for run in runs:
            stop = start + run.tokens
            if stop > floor and start < end:
                speed = self._speeds.get(run.tier)
                total += self._piece(run, speed, max(start, floor), min(stop, end))
            start = stop
        return total

    def record(self, decision: LoadDecision) -> None:
        """Count ``decision`` in :meth:`stats` (the promise path calls it once per
        request)."""
        self._decisions += 1
        self._last_prefill = decision.prefill_tokens_per_s
        for tier, tokens in decision.by_tier.items():
            self._promised[tier] = self._promised.get(tier, 0) + tokens
        declined = False
        for tier, tokens in decision.declined_by_tier.items():
            self._declined[tier] = self._declined.get(tier, 0) + tokens
            declined = declined or tokens > 0
        self._cut += declined

    def stats(self) -> LoadCostStats:
        """Each slow tier's measured speed and the decisions' counts so far."""
        return LoadCostStats(
            tiers=MappingProxyType({name: s.stats() for name, s in self._speeds.items()}),
            prefill_tokens_per_s=self._last_prefill,
            decisions=self._decisions,
            cut_decisions=self._cut,
            promised_tokens=MappingProxyType(dict(self._promised)),
            declined_tokens=MappingProxyType(dict(self._declined)),
        )


def _split_by_tier(runs: Sequence[Run], end: int) -> tuple[dict[str, int], dict[str, int]]:
    """Tokens of ``[0, end)`` and of ``[end, hit)`` per tier."""
    promised: dict[str, int] = {}
    declined: dict[str, int] = {}
    start = 0
    for run in runs:
        stop = start + run.tokens
        inside = max(0, min(stop, end) - start)
        if inside:
            promised[run.tier] = promised.get(run.tier, 0) + inside
        if run.tokens - inside:
            declined[run.tier] = declined.get(run.tier, 0) + run.tokens - inside
        start = stop
    return promised, declined
