"""The text table of a micro-benchmark run (``lmcache-async bench --micro`` prints it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from lmcache_async.bench import format_finite, format_table
from lmcache_async.bench.micro.hashing import HASH_ALGORITHMS

__all__ = ["format_micro"]

_BUSY_SHARE: Final = 0.1
"""Share of the CPUs taken by other work above which the report warns of its effect."""


def _status(ok: bool) -> str:
    return "ok" if ok else "below target"


def _copy_rows(copy: Mapping[str, Any]) -> list[list[str]]:
    """Per operation two rows: the engine's GB/s against the plain ``copy_`` of the same
    bytes, then against the raw gather or scatter of the same rows."""
    mib = copy["bytes"] / 1024**2
    rows: list[list[str]] = []
    for name, raw in (("store", "index_select(out=)"), ("retrieve", "index_copy_")):
        e = copy[name]
        rows.append(
            [
                f"{name} {copy['tokens']} tok {copy['shape']} ({mib:.0f} MiB)",
                f"{format_finite(e['engine_gbps'], '.2f')} GB/s",
                f"plain copy_ {format_finite(e['plain_gbps'], '.2f')} GB/s",
                f"{format_finite(e['plain_ratio'], '.2f')}x",
                f">= {e['plain_target_ratio']:g}x",
                _status(e["plain_ok"]),
            ]
        )
        rows.append(
            [
                "",
                "",
                f"raw {raw} {format_finite(e['raw_gbps'], '.2f')} GB/s",
                f"{format_finite(e['ratio'], '.2f')}x",
                f">= {e['target_ratio']:g}x",
                _status(e["ok"]),
            ]
        )
    return rows


def _small_rows(small: Mapping[str, Any]) -> list[list[str]]:
    """p50 and p99 of the small store and retrieve beside the raw copy, then the cost of
    chunking that copy."""
    calls = small["raw_calls"]
    what = f"{small['tokens']} tok {small['shape']}, chunk {small['chunk_size']}"
    rows: list[list[str]] = []
    for name, raw in (("store", "index_select"), ("retrieve", "index_copy_")):
        e = small[name]
        rows.append(
            [
                f"{name} {what} p50",
                f"{format_finite(e['p50_ms'], '.3f')} ms",
                f"raw {calls} x {raw} {format_finite(e['raw_p50_ms'], '.3f')} ms",
                f"{format_finite(e['ratio'], '.1f')}x",
                f"<= {small['target_p50_ms']:g} ms",
                _status(e["ok"]),
            ]
        )
        rows.append(
            [
                f"{name} {what} p99",
                f"{format_finite(e['p99_ms'], '.3f')} ms",
                f"raw p99 {format_finite(e['raw_p99_ms'], '.3f')} ms",
                "",
                "(info)",
                "",
            ]
        )
    for name, raw in (("store", "index_select"), ("retrieve", "index_copy_")):
        e = small[name]
        rows.append(
            [
                f"{small['chunks']} chunks vs 1 buffer ({name})",
                f"{format_finite(e['raw_chunks_p50_ms'] - e['raw_p50_ms'], '.3f')} ms",
                f"raw {raw} {format_finite(e['raw_p50_ms'], '.3f')} ms",
                "",
                "(info)",
                "",
            ]
        )
    return rows


def _other_work_line(results: Mapping[str, Any]) -> str:
    """What other processes took of the CPUs over the run and during each copy benchmark."""
    run = results["other_work"]
    if run is None:
        return "other processes' CPU time: unknown (no /proc/stat)"
    measured = [
        part
        for part in (results["copy"], results.get("copy_wide"), results["small"])
        if part and part.get("other_work")
    ]
    shares = {part["shape"]: part["other_work"]["other_share"] for part in measured}
    line = (
        f"other processes' CPU time: {run['other_share']:.0%} of the CPUs over the run ("
        + ", ".join(f"{shape} {share:.0%}" for shape, share in shares.items())
        + f"), stolen by the hypervisor {run['steal_share']:.0%}"
    )
    if max(run["other_share"] + run["steal_share"], *shares.values()) > _BUSY_SHARE:
        line += " - a busy machine: it slows torch's baselines more than the engine"
    return line


def format_micro(results: Mapping[str, Any]) -> str:
    """The human-readable table of :func:`~lmcache_async.bench.micro.run_micro` results."""
    copy = results["copy"]
    rows = _copy_rows(copy)
    if results.get("copy_wide"):
        rows += _copy_rows(results["copy_wide"])
    rows += _small_rows(results["small"])
    lookup = results["lookup"]
    for name in ("tensor", "list", "tensor_first_sight"):
        e = lookup[name]
        rows.append(
            [
                f"lookup {lookup['tokens']} tok ({name.replace('_', ' ')}) p50",
                f"{format_finite(e['p50_ms'], '.3f')} ms",
                f"p99 {format_finite(e['p99_ms'], '.3f')} ms",
                "",
                f"<= {lookup['target_p50_ms']:g} ms",
                _status(e["ok"]),
            ]
        )
    hashing = results["hashing"]
    for algorithm in HASH_ALGORITHMS:
        entry = hashing[algorithm]
        for name in ("list", "tensor"):
            is_default = algorithm == "blake3"
            target = hashing[f"target_{name}_mtps"]
            plain = name == "tensor"
            rows.append(
                [
                    f"hash {algorithm} ({name})",
                    f"{format_finite(entry[f'{name}_mtps'], '.1f')} M tok/s",
                    f"plain chain {format_finite(entry['tensor_plain_mtps'], '.1f')} M/s"
                    if plain
                    else "",
                    f"{format_finite(entry['tensor_ratio'], '.2f')}x" if plain else "",
                    f">= {target:g} M/s" if is_default else "(info)",
                    _status(entry[f"{name}_ok"]) if is_default else "",
                ]
            )
    opts = results["options"]
    lines = [
        "lmcache-async micro bench",
        f"default model: {opts['num_layers']} layers x {opts['num_kv_heads']} kv heads x "
        f"{opts['head_size']} ({opts['dtype']}), {results['token_bytes'] / 1024:.1f} KiB per "
        f"token; torch threads: {results['torch_threads']} of {results['cpu_count']} CPUs",
        _other_work_line(results),
        f"figures: {results['method']}",
        "",
        format_table(["figure", "value", "baseline", "ratio", "target", "status"], rows),
        "",
        "retrieve bit-exact: "
        + ", ".join(
            f"{c['shape']} " + ("yes" if c["verified_bit_exact"] else "NO")
            for c in (copy, results.get("copy_wide"), results["small"])
            if c
        ),
        f"small request's raw copy: {results['small']['raw_copy']}",
        "blake3 key chain: "
        + (
            "in C (lmcache_async.keys._native)"
            if hashing.get("native_chain")
            else "the blake3 package (the package was built without its C chain)"
        ),
    ]
    problems = results["problems"]
    if problems:
        lines.append("problems: " + "; ".join(problems))
    lines.append(f"total {results['seconds']:.1f} s")
    return "\n".join(lines)
