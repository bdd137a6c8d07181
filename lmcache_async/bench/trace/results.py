"""A trace replay's figures as plain data (the JSON of ``bench --trace --json``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from lmcache_async.bench import percentiles, plain_data
from lmcache_async.bench.loadgen.tally import Tally
from lmcache_async.bench.trace.bounds import Bounds, LruBound, TraceScan, hit_rate
from lmcache_async.bench.trace.options import TraceOptions
from lmcache_async.bench.trace.sizing import ChunkSize
from lmcache_async.bench.trace.targets import Replayed

__all__ = ["DEFINITIONS", "latency_ms", "served", "tier_occupancy", "trace_results"]

DEFINITIONS: dict[str, str] = {
    "block": "block_size prompt tokens; only full blocks are cached (save_unfull_chunk off); "
    "block j of a request is the same as another's when their first j + 1 hash ids are equal",
    "hit": "a request's leading full blocks present when it arrives, in tokens",
    "hit_rate": "hit tokens / prompt tokens, over the requests replayed",
    "unbounded": "a cache that keeps every block it saw",
    "lru": "a block LRU of the engine's capacity in chunks, accessed as the engine's CPU "
    "tier is: the hit blocks made recent, then the other blocks it holds, then the missing "
    "ones inserted in prompt order, evicting the least recently used",
    "served": "tokens retrieve loaded (not tokens lookup promised) / prompt tokens",
    "capacity": "chunks the tier holds: the CPU pool's bytes over a chunk's pages, or the disk "
    "tier's bytes over a chunk's record",
}


def latency_ms(tally: Tally) -> dict[str, dict[str, float]]:
    """Each step's percentiles, mean and max in ms (``count`` as it is), and ``cache``: the
    lookup, retrieve and store of each request that got through its store, added up."""
    out: dict[str, dict[str, float]] = {}
    columns = dict(tally.latency)
    samples = tally.samples
    if "store_ms" in samples:
        cache = []
        for lookup, retrieve, store in zip(
            samples["lookup_ms"], samples["retrieve_ms"], samples["store_ms"], strict=True
        ):
            if math.isfinite(lookup) and math.isfinite(store):
                cache.append((lookup + store + (retrieve if math.isfinite(retrieve) else 0)) / 1e3)
        columns["cache"] = cache
    for op, values in columns.items():
        stat = {k: v * 1e3 if k != "count" else v for k, v in percentiles(values).items()}
        stat["max"] = max(values) * 1e3 if values else math.nan
        out[op] = stat
    return out


def served(tally: Tally, stats: Mapping[str, Any]) -> dict[str, Any]:
    """What the engine served: tokens loaded by retrieve over prompt tokens. Partial
    stores are the engine's count (a prompt's short last block is never stored, by
    design, and is no partial store)."""
    return {
        "requests": tally.requests,
        "prompt_tokens": tally.prompt_tokens,
        "hit_tokens": tally.tokens_loaded,
        "hit_rate": hit_rate(tally.tokens_loaded, tally.prompt_tokens),
        "lookup_hit_tokens": tally.lookup_hit_tokens,
        "retrieves": tally.retrieves,
        "retrieve_short": tally.retrieve_short,
        "tokens_stored": tally.tokens_stored,
        "output_tokens": tally.output_tokens,
        "partial_stores": stats.get("partial_stores"),
        "verified_retrieves": tally.verified,
        "verify_failures": tally.verify_failures,
        "errors": dict(tally.errors),
        "errors_total": sum(tally.errors.values()),
    }


def tier_occupancy(
    stats: Mapping[str, Any], capacities: Mapping[str, int | None]
) -> dict[str, Any]:
    """Each tier's chunks, bytes, evictions and capacity (chunks) at the end of a replay."""
    out: dict[str, Any] = {}
    for name, tier in (stats.get("tiers") or {}).items():
        if not isinstance(tier, Mapping):
            continue
        out[name] = {
            "chunks": tier.get("chunks"),
            "bytes": tier.get("bytes"),
            "evictions": tier.get("evictions"),
            "puts": tier.get("puts"),
            "capacity_chunks": capacities.get(name),
        }
    return out


def _lru(bound: LruBound | None, tier: str | None) -> dict[str, Any] | None:
    if bound is None:
        return None
    data: dict[str, Any] = plain_data(bound)
    data["tier"] = tier
    return data


def _divergence(per_request: Sequence[int] | None, tally: Tally) -> dict[str, Any] | None:
    """The first request (in arrival order, from 1) whose loaded tokens differ from its hit
    in the LRU, and how many differ; None when they all agree or cannot be paired."""
    loaded = tally.samples.get("loaded_tokens")
    if per_request is None or loaded is None or len(loaded) != len(per_request):
        return None
    differ = [i for i, (a, b) in enumerate(zip(loaded, per_request, strict=True)) if a != b]
    if not differ:
        return None
    first = differ[0]
    return {
        "request": first + 1,
        "served_tokens": int(loaded[first]),
        "lru_tokens": per_request[first],
        "requests_differing": len(differ),
    }


def _beside(beside: Tally | None, tally: Tally, lru: LruBound | None) -> dict[str, Any] | None:
    """The embedded engine replayed beside the target (``--beside-embedded``): its hit
    rate and latency, and the target's p50 and mean over its (ratios per operation)."""
    if beside is None:
        return None
    ours, theirs = latency_ms(tally), latency_ms(beside)
    ratios = {}
    for op, stat in ours.items():
        other = theirs.get(op)
        if other and other.get("p50") and other.get("mean"):
            ratios[op] = {"p50": stat["p50"] / other["p50"], "mean": stat["mean"] / other["mean"]}
    got = served(beside, {})
    return {
        "target": "embedded",
        "served": got,
        "served_equals_lru": None if lru is None else got["hit_tokens"] == lru.hit_tokens,
        "latency_ms": theirs,
        "ratio": ratios,
    }


def trace_results(
    options: TraceOptions,
    scan: TraceScan,
    bounds: Bounds,
    *,
    main: Replayed | None,
    capacities: Mapping[str, int | None],
    lru_tier: str | None,
    chunk: ChunkSize,
    layout: Mapping[str, Any],
    disk_record: int | None,
    sweep: list[dict[str, Any]],
    notes: list[str],
) -> dict[str, Any]:
    """Every figure of a replay (``main`` None: nothing was replayed, an empty trace)."""
    lru = bounds.lru[0] if bounds.lru and lru_tier is not None else None
    tally = main.tally if main is not None else Tally()
    stats = main.stats if main is not None else {}
    divergence = None
    if main is not None and options.concurrency == 1 and options.target != "vllm":
        divergence = _divergence(bounds.per_request, tally)
    got = served(tally, stats)
    return {
        "trace": {
            "path": options.path,
            "block_size": options.block_size,
            "limit": options.limit,
            "requests": scan.requests,
            "prompt_tokens": scan.prompt_tokens,
            "full_block_tokens": scan.full_block_tokens,
            "output_tokens": scan.output_tokens,
            "max_prompt_tokens": scan.max_prompt_tokens,
            "span_seconds": scan.span_seconds,
            "distinct_blocks": bounds.distinct_blocks,
        },
        "definitions": DEFINITIONS,
        "target": options.target,
        "url": main.url if main is not None else options.url,
        "stream": bool((stats.get("client") or {}).get("stream")),
        "concurrency": options.concurrency,
        "speed": options.speed,
        "options": plain_data(options),
        "engine_config": None if main is None or main.config is None else main.config.to_dict(),
        "vllm": main.vllm if main is not None else {},
        "layout": dict(layout),
        "chunk": plain_data(chunk),
        "disk_record_bytes": disk_record,
        "capacities": dict(capacities),
        "bounds": {
            "unbounded": {
                "hit_tokens": bounds.unbounded_hit_tokens,
                "hit_rate": bounds.unbounded_hit_rate,
            },
            "lru": _lru(lru, lru_tier),
        },
        "served": got,
        "served_equals_lru": (
            None
            if lru is None or main is None
            else got["hit_tokens"] == lru.hit_tokens and got["prompt_tokens"] == scan.prompt_tokens
        ),
        "divergence": divergence,
        "wall_seconds": main.wall if main is not None else 0.0,
        "requests_per_second": (
            tally.requests / main.wall if main is not None and main.wall > 0 else math.nan
        ),
        "latency_ms": latency_ms(tally),
        "occupancy": tier_occupancy(stats, capacities),
        "evicted_chunks": stats.get("evicted_chunks"),
        "cached_chunks_at_start": main.cached_chunks_at_start if main is not None else None,
        "engine_stats": stats,
        "samples": tally.samples,
        "sweep": sweep,
        "beside": _beside(main.beside if main is not None else None, tally, lru),
        "errors": got["errors"],
        "errors_total": got["errors_total"],
        "verify_failures": got["verify_failures"],
        "notes": notes,
    }
