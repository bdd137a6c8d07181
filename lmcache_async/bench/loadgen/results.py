"""A load run's figures as plain data (the JSON of ``lmcache-async bench --json``)."""

from __future__ import annotations

import math
from typing import Any

from lmcache_async import EngineConfig, KVLayout
from lmcache_async.bench import percentiles, plain_data
from lmcache_async.bench.loadgen.options import LoadOptions
from lmcache_async.bench.loadgen.runner import VERIFY_SAMPLE
from lmcache_async.bench.loadgen.tally import Tally
from lmcache_async.bench.workloads import Workload

__all__ = ["load_results", "vllm_results"]


def _latency_ms(tally: Tally) -> dict[str, dict[str, float]]:
    """Each timed step's percentiles and ``max`` (the longest any one call held its
    caller), in milliseconds (``count`` as it is)."""
    out: dict[str, dict[str, float]] = {}
    for op, vals in tally.latency.items():
        stat = {k: v * 1e3 if k != "count" else v for k, v in percentiles(vals).items()}
        stat["max"] = max(vals) * 1e3 if vals else math.nan
        out[op] = stat
    return out


def _unreachable(stats: dict[str, Any]) -> int:
    """Calls a sidecar client made while it had no link: misses, not errors."""
    client = stats.get("client") or {}
    return int(client.get("unavailable") or 0)


def _per_second(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else math.nan


def vllm_results(
    options: LoadOptions,
    config: EngineConfig,
    workload: Workload,
    *,
    tally: Tally,
    wall: float,
    stats: dict[str, Any],
    run: dict[str, Any],
    chunk_size: int | None,
    in_flight: int,
) -> dict[str, Any]:
    embedded = run["connector"] == "embedded"
    return {
        "workload": workload.name,
        "workload_description": workload.describe(),
        "target": options.target,
        "options": plain_data(options),
        "engine_config": config.to_dict() if embedded else None,
        "vllm": run,
        "chunk_size": chunk_size,
        "in_flight": in_flight,
        "wall_seconds": wall,
        "requests": tally.requests,
        "requests_per_second": _per_second(tally.requests, wall),
        "conversations": getattr(workload, "conversations", None),
        "prompt_tokens": tally.prompt_tokens,
        "output_tokens": tally.output_tokens,
        "external_tokens": tally.external_tokens,
        "tokens_loaded": tally.tokens_loaded,
        "load_failed_tokens": tally.load_failed_tokens,
        "requests_loading": tally.retrieves,
        "hit_rate": (
            tally.tokens_loaded / tally.prompt_tokens if tally.prompt_tokens else math.nan
        ),
        "tokens_per_second_loaded": _per_second(tally.tokens_loaded, wall),
        "tokens_stored": tally.tokens_stored,
        "tokens_per_second_stored": _per_second(tally.tokens_stored, wall),
        "latency_ms": _latency_ms(tally),
        "errors": dict(tally.errors),
        "errors_total": sum(tally.errors.values()),
        "verify_failures": 0,
        "engine_stats": stats,
        "samples": tally.samples,
    }


def load_results(
    options: LoadOptions,
    config: EngineConfig,
    workload: Workload,
    *,
    layout: KVLayout,
    tally: Tally,
    wall: float,
    stats: dict[str, Any],
    finish: dict[str, Any],
    chunk_size: int,
    in_flight: int,
) -> dict[str, Any]:
    token_bytes = layout.token_bytes
    latency = _latency_ms(tally)
    bytes_stored = tally.tokens_stored * token_bytes
    bytes_loaded = tally.tokens_loaded * token_bytes
    store_time = sum(tally.latency["store"])
    retrieve_time = sum(tally.latency["retrieve"])
    per_second = _per_second
    results: dict[str, Any] = {
        "workload": workload.name,
        "workload_description": workload.describe(),
        "target": options.target,
        "options": plain_data(options),
        "engine_config": config.to_dict() if options.target == "embedded" else None,
        "chunk_size": chunk_size,
        "in_flight": in_flight,
        "token_bytes": token_bytes,
        "wall_seconds": wall,
        "requests": tally.requests,
        "requests_per_second": per_second(tally.requests, wall),
        "conversations": getattr(workload, "conversations", None),
        "lookups": tally.lookups,
        "prompt_tokens": tally.prompt_tokens,
        "lookup_hit_tokens": tally.lookup_hit_tokens,
        "hit_rate": (
            tally.lookup_hit_tokens / tally.prompt_tokens if tally.prompt_tokens else math.nan
        ),
        "retrieves": tally.retrieves,
        "retrieve_short": tally.retrieve_short,
        "tokens_loaded": tally.tokens_loaded,
        "tokens_per_second_loaded": per_second(tally.tokens_loaded, wall),
        "bytes_loaded": bytes_loaded,
        "gb_loaded": bytes_loaded / 1e9,
        "gbps_loaded_op": per_second(bytes_loaded, retrieve_time) / 1e9,
        "gbps_loaded_wall": per_second(bytes_loaded, wall) / 1e9,
        "stores": tally.stores,
        "store_requested_tokens": tally.store_requested_tokens,
        "tokens_stored": tally.tokens_stored,
        "tokens_per_second_stored": per_second(tally.tokens_stored, wall),
        "bytes_stored": bytes_stored,
        "gb_stored": bytes_stored / 1e9,
        "gbps_stored_op": per_second(bytes_stored, store_time) / 1e9,
        "gbps_stored_wall": per_second(bytes_stored, wall) / 1e9,
        "partial_stores": tally.partial_stores,
        "latency_ms": latency,
        "errors": dict(tally.errors),
        "errors_total": sum(tally.errors.values()),
        "unreachable_calls": _unreachable(stats),
        "verify_sample": VERIFY_SAMPLE,
        "verified_retrieves": tally.verified,
        "verify_failures": tally.verify_failures,
        "engine_stats": stats,
        "samples": tally.samples,
    }
    results.update(finish)
    return results
