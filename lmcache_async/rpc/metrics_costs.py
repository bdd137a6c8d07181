"""Prometheus series of the load-or-recompute model and of store admission.

From ``EngineStats.load_costs``: each slow tier's measured read speed
(``tier_read_throughput_bytes_per_second{tier}``, ``tier_read_latency_seconds{tier}``,
reported once measured; ``tier_read_samples_total{tier}``), the prefill speed the last
decision used (``prefill_tokens_per_second``, once known), and the decisions
(``load_decisions_total``, ``load_cut_decisions_total``, ``load_promised_tokens_total{tier}``,
``load_declined_tokens_total{tier}``). From ``EngineStats.admission``: the threshold, the
chunks counted, and the chunks admitted, held back and written behind (``admission_*``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from lmcache_async.stats import EngineStats

__all__ = ["cost_metrics"]

_PREFIX: Final = "lmcache_async"


def _name(suffix: str) -> str:
    return f"{_PREFIX}_{suffix}"


def _by_tier(family: CounterMetricFamily, values: Mapping[str, float]) -> CounterMetricFamily:
    for tier, value in sorted(values.items()):
        family.add_metric([tier], float(value))
    return family


def cost_metrics(s: EngineStats) -> Iterator[Metric]:
    """The series of ``s.load_costs`` and ``s.admission``."""
    costs = s.load_costs
    labels = ["tier"]
    throughput = GaugeMetricFamily(
        _name("tier_read_throughput_bytes_per_second"),
        "Measured read throughput of a slow tier, beyond each call's latency",
        labels=labels,
    )
    latency = GaugeMetricFamily(
        _name("tier_read_latency_seconds"),
        "Measured time a slow tier's read call costs whatever its size",
        labels=labels,
    )
    samples = CounterMetricFamily(
        _name("tier_read_samples"), "Slow-tier read calls measured", labels=labels
    )
    for tier, speed in sorted(costs.tiers.items()):
        if speed.throughput_bytes_per_s is not None:
            throughput.add_metric([tier], speed.throughput_bytes_per_s)
        if speed.latency_s is not None:
            latency.add_metric([tier], speed.latency_s)
        samples.add_metric([tier], float(speed.samples))
    yield throughput
    yield latency
    yield samples
    if costs.prefill_tokens_per_s is not None:
        yield GaugeMetricFamily(
            _name("prefill_tokens_per_second"),
            "The serving engine's prefill speed the last load decision used",
            value=costs.prefill_tokens_per_s,
        )
    yield CounterMetricFamily(
        _name("load_decisions"), "Load-or-recompute decisions made", value=costs.decisions
    )
    yield CounterMetricFamily(
        _name("load_cut_decisions"),
        "Decisions that left part of a cached prefix to recompute",
        value=costs.cut_decisions,
    )
    yield _by_tier(
        CounterMetricFamily(
            _name("load_promised_tokens"), "Cached tokens worth loading", labels=labels
        ),
        costs.promised_tokens,
    )
    yield _by_tier(
        CounterMetricFamily(
            _name("load_declined_tokens"),
            "Cached tokens cheaper to recompute than to load",
            labels=labels,
        ),
        costs.declined_tokens,
    )

    admission = s.admission
    yield GaugeMetricFamily(
        _name("admission_threshold"),
        "Sightings of a chunk before it goes to the slow tiers",
        value=admission.threshold,
    )
    yield GaugeMetricFamily(
        _name("admission_tracked_chunks"),
        "Chunks whose sightings are counted",
        value=admission.tracked_chunks,
    )
    for suffix, doc, value in (
        (
            "admission_admitted_chunks",
            "Stored chunks sent to the slow tiers at once",
            admission.admitted_chunks,
        ),
        (
            "admission_held_back_chunks",
            "Stored chunks kept from the slow tiers, seen too few times",
            admission.held_back_chunks,
        ),
        (
            "admission_written_behind_chunks",
            "Held-back chunks written once seen enough",
            admission.written_behind_chunks,
        ),
    ):
        yield CounterMetricFamily(_name(suffix), doc, value=value)
