"""The figures of ``bench --redis`` from its raw timings (medians, and each ratio as the
median of the rounds' own ratios), the goals they are held to, and the text table."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from lmcache_async.bench import format_finite, format_table
from lmcache_async.bench.redis.options import GOALS

__all__ = ["format_redis", "summarise_first_stores", "summarise_wire"]

_MIB = 1 << 20
_KIND_LABELS = {
    "on": "on (default), store at once",
    "on_done": "on, store after the fault-in",
    "off": "off",
}


def _ms(seconds: Sequence[float]) -> list[float]:
    return [s * 1e3 for s in seconds]


def _ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """The median of the rounds' own ratios (the rounds pair up in order)."""
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def summarise_wire(times_s: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """The Redis part's figures from each write's and read's times over the rounds:
    ``median_ms`` of each, and per path (``embedded``, ``sidecar``) its retrieve and its
    write to Redis (the store into RAM and Redis less the store into RAM only, round by
    round) in ms with their ratios to the plain socket's ``GET`` s and ``SET`` s."""
    ms = {name: _ms(values) for name, values in times_s.items()}
    figures: dict[str, Any] = {
        "times_ms": ms,
        "median_ms": {name: statistics.median(values) for name, values in ms.items()},
    }
    for path in ("embedded", "sidecar"):
        writes = [a - b for a, b in zip(ms[f"{path}_store"], ms[f"{path}_ram_store"], strict=True)]
        figures[path] = {
            "retrieve_ms": statistics.median(ms[f"{path}_retrieve"]),
            "retrieve_ratio": _ratio(ms[f"{path}_retrieve"], ms["plain_get"]),
            "write_ms": statistics.median(writes),
            "write_ratio": _ratio(writes, ms["plain_set"]),
            "writes_ms": writes,
        }
    return figures


def summarise_first_stores(kinds: Mapping[str, Mapping[str, Sequence[float]]]) -> dict[str, Any]:
    """Per kind of engine, the first and steady stores in ms (each trial's, and their
    medians) and the median of the trials' first / steady ratios."""
    out: dict[str, Any] = {}
    for kind, times in kinds.items():
        first, steady = _ms(times["first_s"]), _ms(times["steady_s"])
        out[kind] = {
            "first_ms": first,
            "steady_ms": steady,
            "first_median_ms": statistics.median(first),
            "steady_median_ms": statistics.median(steady),
            "ratio": _ratio(first, steady),
        }
    return out


def above_goals(results: Mapping[str, Any]) -> list[str]:
    """Each ratio above its goal, said in a few words."""
    wire, first = results["wire"], results["first_store"]["kinds"]
    checks = [
        (f"{path} {op}", wire[path][f"{op}_ratio"], GOALS[f"{op}_ratio"])
        for path in ("embedded", "sidecar")
        for op in ("retrieve", "write")
    ]
    checks.append(("first store, prefault on", first["on"]["ratio"], GOALS["first_store_ratio"]))
    return [f"{what} {ratio:.2f}x > {goal}x" for what, ratio, goal in checks if ratio > goal]


def format_redis(results: Mapping[str, Any]) -> str:
    """The two tables: the Redis part (each path's median beside the plain socket's, the
    ratio, the goal) and the first-store part (per kind of engine)."""
    options, wire = results["options"], results["wire"]
    plain = wire["median_ms"]
    chunk_mib = results["chunk_bytes"] / _MIB
    lines = [
        f"Redis at the wire: {options['chunks']} chunks of {chunk_mib:.2f} MiB only in Redis "
        f"({results['request_bytes'] / _MIB:.1f} MiB a request), {options['rounds']} rounds, "
        f"{results['server']}",
    ]
    rows = []
    for op, base in (("retrieve", "plain_get"), ("write", "plain_set")):
        for path in ("embedded", "sidecar"):
            figures = wire[path]
            rows.append(
                [
                    f"{op}, {path}",
                    format_finite(figures[f"{op}_ms"], ".2f"),
                    format_finite(plain[base], ".2f"),
                    format_finite(figures[f"{op}_ratio"], ".2f"),
                    f"<= {GOALS[f'{op}_ratio']}",
                ]
            )
    lines.append(format_table(["path", "median ms", "plain ms", "ratio", "goal"], rows))
    lines.append(
        "plain: GETs received into distinct preallocated buffers, SETs sent from memory; "
        "write = store into RAM and Redis (waiting for Redis) less a store into RAM only "
        "(embedded {:.2f} - {:.2f} ms, sidecar {:.2f} - {:.2f} ms); ratio = median of the "
        "rounds' ratios".format(
            plain["embedded_store"],
            plain["embedded_ram_store"],
            plain["sidecar_store"],
            plain["sidecar_ram_store"],
        )
    )
    first = results["first_store"]
    lines.append("")
    lines.append(
        f"A fresh engine's first store of {results['request_bytes'] / _MIB:.1f} MiB beside its "
        f"steady state: pool of {first['pool_bytes'] / _MIB:.0f} MiB, {options['rounds']} "
        "engines of each kind"
    )
    rows = []
    for kind in ("on", "on_done", "off"):
        figures = first["kinds"][kind]
        rows.append(
            [
                _KIND_LABELS[kind],
                format_finite(figures["first_median_ms"], ".2f"),
                format_finite(figures["steady_median_ms"], ".2f"),
                format_finite(figures["ratio"], ".2f"),
                f"<= {GOALS['first_store_ratio']}" if kind == "on" else "",
            ]
        )
    lines.append(format_table(["pool prefault", "first ms", "steady ms", "ratio", "goal"], rows))
    floor = first.get("plain")
    if floor is not None:
        fresh, resident = floor["first_median_ms"], floor["steady_median_ms"]
        lines.append(
            "plain: one thread writing the request's bytes into fresh pages (huge pages "
            f"asked for) {fresh:.2f} ms, into the same pages again {resident:.2f} ms: first "
            f"touching {results['request_bytes'] / _MIB:.1f} MiB costs one thread about "
            f"{fresh - resident:.2f} ms here (a store's copy threads and the prefault worker "
            "share it)"
        )
    lines.extend(f"above goal: {item}" for item in results.get("above_goal", []))
    lines.extend(f"problem: {item}" for item in results.get("problems", []))
    return "\n".join(lines)
