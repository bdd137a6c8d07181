"""The text summary of a load run's results (``lmcache-async bench`` prints it)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lmcache_async.bench import format_table

__all__ = ["format_summary"]


def _fmt(value: float | None, spec: str) -> str:
    """``value`` formatted, or ``-`` when it is missing (None after JSON) or not finite."""
    if value is None or not math.isfinite(value):
        return "-"
    return format(value, spec)


def format_summary(results: Mapping[str, Any]) -> str:
    """The human-readable summary of :func:`~lmcache_async.bench.loadgen.run_load` results
    (also of results read back from their JSON file)."""
    if results["target"] == "vllm":
        return _format_vllm_summary(results)
    opts = results["options"]
    kib = results["token_bytes"] / 1024
    load = _load_line(results)
    target = results["target"]
    if target == "sidecar":
        target = f"sidecar {opts['url']}"
    ran = (
        f"ran {results['wall_seconds']:.1f} s: {results['requests']} requests "
        f"({_fmt(results['requests_per_second'], '.1f')} req/s)"
    )
    if results.get("conversations") is not None:
        ran += f", {results['conversations']} conversations"
    hit_rate = results["hit_rate"]
    lines = [
        f"lmcache-async bench: {results['workload']} against {target}",
        f"model: {opts['num_layers']} layers x {opts['num_kv_heads']} kv heads x "
        f"{opts['head_size']} ({opts['dtype']}), {kib:.1f} KiB KV per token, "
        f"chunk {results['chunk_size']}",
        f"workload: {results['workload_description']}",
        f"load: {load}",
        ran,
        "",
        f"hit rate: {_fmt(None if hit_rate is None else hit_rate * 100, '.1f')} % "
        f"({results['lookup_hit_tokens']} of {results['prompt_tokens']} prompt tokens)",
        "",
    ]
    transfer = [
        [
            kind,
            str(results[f"tokens_{kind}"]),
            _fmt(results[f"tokens_per_second_{kind}"], ".0f"),
            _fmt(results[f"gb_{kind}"], ".3f"),
            _fmt(results[f"gbps_{kind}_op"], ".2f"),
            _fmt(results[f"gbps_{kind}_wall"], ".2f"),
        ]
        for kind in ("stored", "loaded")
    ]
    header = ["KV", "tokens", "tokens/s", "GB", "GB/s (in op)", "GB/s (wall)"]
    lines += [format_table(header, transfer), ""]
    lines.append(_latency_table(results, {"compute": "compute (prefill)"}))
    lines.append("")
    stats = results["engine_stats"]
    lines.append(
        f"partial stores: {results['partial_stores']}, short retrieves: "
        f"{results['retrieve_short']}, evicted chunks: {stats.get('evicted_chunks', '-')}, "
        f"cached chunks at end: {stats.get('cached_chunks', '-')}"
    )
    lines.append(_errors_line(results))
    if results.get("unreachable_calls"):
        lines.append(
            f"calls while the sidecar was unreachable (misses): {results['unreachable_calls']}"
        )
    verified = (
        f"verified {results['verified_retrieves']} retrieves bit-exact (each on the first and "
        f"last token of every chunk and {results['verify_sample']} random tokens)"
    )
    if results["verify_failures"]:
        verified += f", {results['verify_failures']} MISMATCHED"
    lines.append(verified)
    return "\n".join(lines)


def _load_line(results: Mapping[str, Any]) -> str:
    opts = results["options"]
    if opts["rate"]:
        return (
            f"{opts['rate']:g} requests/s ({opts['arrival']}), "
            f"at most {results['in_flight']} in flight"
        )
    return f"closed loop, {results['in_flight']} in flight"


def _latency_table(results: Mapping[str, Any], names: Mapping[str, str]) -> str:
    """Each step's count, percentiles, mean and ``max``: the longest any one call held
    its caller (``-`` in results written before it was kept)."""
    rows = []
    for op, stat in results["latency_ms"].items():
        rows.append(
            [
                names.get(op, op),
                str(int(stat["count"])),
                *(_fmt(stat.get(k), ".2f") for k in ("p50", "p90", "p99", "mean", "max")),
            ]
        )
    header = ["latency", "count", "p50 ms", "p90 ms", "p99 ms", "mean ms", "max ms"]
    return format_table(header, rows)


def _errors_line(results: Mapping[str, Any]) -> str:
    errors = results["errors"]
    if not errors:
        return "errors: 0"
    detail = ", ".join(f"{k}={v}" for k, v in sorted(errors.items()))
    return f"errors: {results['errors_total']} ({detail})"


def _format_vllm_summary(results: Mapping[str, Any]) -> str:
    """The summary of a run against vLLM: time to first token and the connector's counts."""
    opts = results["options"]
    run = results["vllm"]
    connector = run["connector"]
    if connector == "sidecar":
        connector = f"sidecar {opts['url']}"
    chunk = results["chunk_size"]
    ran = (
        f"ran {results['wall_seconds']:.1f} s: {results['requests']} requests "
        f"({_fmt(results['requests_per_second'], '.1f')} req/s)"
    )
    if results.get("conversations") is not None:
        ran += f", {results['conversations']} conversations"
    hit_rate = results["hit_rate"]
    warmup = run["warmup_seconds"]
    lines = [
        f"lmcache-async bench: {results['workload']} against vllm (connector: {connector})",
        f"model: {run['model']}, max_model_len {run['max_model_len']}, "
        f"{opts['max_tokens']} output token(s) per request"
        + (f", chunk {chunk}" if chunk is not None else ""),
        f"vllm: started in {run['startup_seconds']:.1f} s"
        + (f", warm-up request {warmup:.2f} s" if warmup is not None else ""),
        f"workload: {results['workload_description']}",
        f"load: {_load_line(results)}",
        ran,
        "",
        f"hit rate: {_fmt(None if hit_rate is None else hit_rate * 100, '.1f')} % "
        f"({results['tokens_loaded']} of {results['prompt_tokens']} prompt tokens loaded by "
        f"the connector, in {results['requests_loading']} requests; "
        f"{results['external_tokens']} offered, {results['load_failed_tokens']} failed)",
        f"stored: {results['tokens_stored']} tokens "
        f"({_fmt(results['tokens_per_second_stored'], '.0f')} tokens/s), loaded: "
        f"{_fmt(results['tokens_per_second_loaded'], '.0f')} tokens/s",
        "",
        _latency_table(results, {"ttft": "time to first token", "request": "request"}),
        "",
        _errors_line(results),
    ]
    return "\n".join(lines)
