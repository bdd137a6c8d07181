"""The text summary of a trace replay's results (``lmcache-async bench --trace`` prints it)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lmcache_async.bench import format_table

__all__ = ["format_bytes", "format_tokens", "format_trace"]


def _rate(value: float | None) -> str:
    """A hit rate, or ``-`` when there is none (no request)."""
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.4f}"


def _ms(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.2f}"


def format_tokens(tokens: int | None) -> str:
    """``3000000`` as ``3M``, ``512000`` as ``512k``."""
    if tokens is None:
        return "-"
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if tokens >= size:
            return f"{tokens / size:.4g}{suffix}"
    return str(tokens)


def format_bytes(nbytes: int | None) -> str:
    """Bytes in binary units (``64.0 KiB``, ``1.50 GiB``)."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def _pace(results: Mapping[str, Any]) -> str:
    speed = results["speed"]
    if speed is None:
        return f"closed loop, {results['concurrency']} in flight"
    return f"at the trace's timestamps x{speed:g}, at most {results['concurrency']} in flight"


def _tiers(results: Mapping[str, Any]) -> str:
    bs = results["trace"]["block_size"]
    parts = []
    for name, chunks in results["capacities"].items():
        if chunks is not None:
            parts.append(f"{name} {chunks} chunks ({format_tokens(chunks * bs)} tokens)")
    return ", ".join(parts) or "-"


def format_trace(results: Mapping[str, Any]) -> str:
    """The human-readable summary of :func:`~lmcache_async.bench.trace.run_trace` results
    (also of results read back from their JSON file)."""
    trace = results["trace"]
    layout = results["layout"]
    chunk = results["chunk"]
    bounds = results["bounds"]
    served = results["served"]
    lru = bounds["lru"]
    target = results["target"] + (f" {results['url']}" if results.get("url") else "")
    if results.get("url") and results["target"] == "sidecar":
        target += " (same-host stream)" if results.get("stream") else " (ZeroMQ)"
    lines = [
        f"lmcache-async bench --trace {trace['path']}: {trace['requests']} requests, "
        f"{format_tokens(trace['prompt_tokens'])} prompt tokens, blocks of "
        f"{trace['block_size']} tokens, {trace['distinct_blocks']} distinct, "
        f"{trace['span_seconds']:.0f} s of arrivals",
        f"replay: {target}, {_pace(results)}; model {layout['num_layers']} layers x "
        f"{layout['num_kv_heads']} kv heads x {layout['head_size']} ({layout['dtype']}), "
        f"{layout['token_bytes']} B of KV per token, {format_bytes(chunk['payload'])} per chunk",
        f"tiers: {_tiers(results)}",
        "",
        "hit rate = hit tokens / prompt tokens; a request's hit = its leading full blocks "
        "present when it arrives",
    ]
    rows = [["trace, unbounded cache", _rate(bounds["unbounded"]["hit_rate"]), "-", "-"]]
    if lru is not None:
        rows.append(
            [
                f"block LRU, {lru['capacity_blocks']} chunks ({lru['tier']} tier)",
                _rate(lru["hit_rate"]),
                str(lru["evictions"]),
                "-",
            ]
        )
    match = results.get("served_equals_lru")
    note = "-" if match is None else "= LRU" if match else "differs from LRU"
    # The engine's evictions from the tier the bound is of.
    tier = results["occupancy"].get(lru["tier"] if lru is not None else "cpu") or {}
    rows.append(
        [
            "served (tokens loaded by retrieve)",
            _rate(served["hit_rate"]),
            str(tier.get("evictions") or 0),
            note,
        ]
    )
    lines += [format_table(["", "hit rate", "evictions", ""], rows)]
    divergence = results.get("divergence")
    if divergence:
        lines.append(
            f"first difference: request {divergence['request']} loaded "
            f"{divergence['served_tokens']} tokens, the LRU hits {divergence['lru_tokens']} "
            f"({divergence['requests_differing']} requests differ)"
        )
    lines += ["", _latency(results["latency_ms"]), "", _occupancy(results)]
    if results.get("beside"):
        lines += ["", _beside(results)]
    if results["sweep"]:
        lines += ["", _sweep(results)]
    lines.append(_errors(results))
    lines.extend(f"note: {note}" for note in results["notes"])
    return "\n".join(lines)


def _latency(latency: Mapping[str, Mapping[str, float]]) -> str:
    names = {"compute": "compute (prefill)", "cache": "lookup+retrieve+store", "ttft": "ttft"}
    rows = [
        [
            names.get(op, op),
            str(int(stat["count"])),
            *(_ms(stat.get(k)) for k in ("p50", "p90", "p99", "mean", "max")),
        ]
        for op, stat in latency.items()
    ]
    header = ["latency", "count", "p50 ms", "p90 ms", "p99 ms", "mean ms", "max ms"]
    return format_table(header, rows)


def _beside(results: Mapping[str, Any]) -> str:
    """The target beside an embedded engine that took the same requests, interleaved."""
    beside = results["beside"]
    ours, theirs = results["latency_ms"], beside["latency_ms"]
    names = {"compute": "compute (prefill)", "cache": "lookup+retrieve+store"}
    rows = []
    for op, ratio in beside["ratio"].items():
        rows.append(
            [
                names.get(op, op),
                _ms(ours[op]["p50"]),
                _ms(theirs[op]["p50"]),
                f"{ratio['p50']:.2f}x",
                _ms(ours[op]["mean"]),
                _ms(theirs[op]["mean"]),
                f"{ratio['mean']:.2f}x",
            ]
        )
    match = beside.get("served_equals_lru")
    served = _rate(beside["served"]["hit_rate"])
    header = [
        f"{results['target']} / embedded",
        "p50 ms",
        "embedded",
        "ratio",
        "mean ms",
        "embedded",
        "ratio",
    ]
    head = (
        f"beside an embedded engine of the same tiers, the same requests interleaved "
        f"(served {served}{'' if match is None else ' = LRU' if match else ', differs from LRU'}):"
    )
    return head + "\n" + format_table(header, rows)


def _occupancy(results: Mapping[str, Any]) -> str:
    rows = []
    for name, tier in results["occupancy"].items():
        capacity = tier.get("capacity_chunks")
        rows.append(
            [
                name,
                str(tier.get("chunks", "-")),
                "-" if capacity is None else str(capacity),
                format_bytes(tier.get("bytes")),
                str(tier.get("evictions", "-")),
            ]
        )
    if not rows:
        return "tiers at the end: -"
    return format_table(["tier at the end", "chunks", "of", "bytes", "evictions"], rows)


def _sweep(results: Mapping[str, Any]) -> str:
    disk = results["capacities"].get("disk") is not None
    replayed_any = any(row.get("served") for row in results["sweep"])
    rows = []
    for row in results["sweep"]:
        cells = [
            format_tokens(row["capacity_tokens"]),
            str(row["capacity_blocks"]),
            format_bytes(row["kv_bytes"]),
            format_bytes(row["disk_bytes"] if disk else row["cpu_bytes"]),
            _rate(row["lru_hit_rate"]),
        ]
        replayed = row.get("served")
        if replayed_any:
            if replayed is None:
                cells += ["-"] * 5
            else:
                cache = replayed["latency_ms"].get("cache", {})
                cells += [
                    _rate(replayed["hit_rate"]),
                    f"{replayed['capacity_blocks']}: {_rate(replayed['lru_hit_rate'])}",
                    _ms(cache.get("p50")),
                    _ms(cache.get("mean")),
                    str(replayed.get("evicted_chunks") or 0),
                ]
        rows.append(cells)
    tier = "disk" if disk else "cpu"
    header = [f"{tier} tier tokens", "chunks", "KV bytes", f"{tier} bytes", "LRU hit"]
    if replayed_any:
        header += ["served", "its chunks: LRU", "cache p50 ms", "mean ms", "evicted"]
    return format_table(header, rows)


def _errors(results: Mapping[str, Any]) -> str:
    errors = results["errors"]
    served = results["served"]
    verified = (
        f"verified retrieves: {served['verified_retrieves']}"
        + (f", {served['verify_failures']} MISMATCHED" if served["verify_failures"] else "")
        + f"; partial stores: {served['partial_stores'] or 0}, short retrieves: "
        f"{served['retrieve_short']}"
    )
    if not errors:
        return f"errors: 0; {verified}"
    detail = ", ".join(f"{k}={v}" for k, v in sorted(errors.items()))
    return f"errors: {results['errors_total']} ({detail}); {verified}"
