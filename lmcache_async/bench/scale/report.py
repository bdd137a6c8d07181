"""The scale benchmark's figures as text, and the growth exponent of a cost between two
sizes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from lmcache_async.bench import format_finite, format_table
from lmcache_async.bench.scale.options import INDEX_OVER_WALK_TARGET
from lmcache_async.bench.scale.requests import OPERATIONS

__all__ = ["format_scale", "growth_exponent", "growth_exponents"]

_OP_HEADERS = [f"{op} p50 ms" for op in OPERATIONS]


def growth_exponent(small: tuple[float, float], large: tuple[float, float]) -> float:
    """``k`` in ``t ~ N**k`` between two ``(N, t)`` points:
    ``log(t_large / t_small) / log(N_large / N_small)``; 0 is flat, 1 linear. ``nan`` when
    a time is not a positive number or the sizes are equal."""
    (n_small, t_small), (n_large, t_large) = small, large
    if (
        not (t_small > 0 and t_large > 0)
        or not (math.isfinite(t_small) and math.isfinite(t_large))
        or n_small <= 0
        or n_large <= 0
        or n_small == n_large
    ):
        return math.nan
    return math.log(t_large / t_small) / math.log(n_large / n_small)


def growth_exponents(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Each operation's p50 growth exponent between the smallest and the largest size of
    ``rows`` (``nan`` with fewer than two sizes)."""
    if len(rows) < 2:
        return dict.fromkeys(OPERATIONS, math.nan)
    small = min(rows, key=lambda row: row["chunks"])
    large = max(rows, key=lambda row: row["chunks"])
    return {
        op: growth_exponent(
            (small["chunks"], small["ops"][op]["p50"]), (large["chunks"], large["ops"][op]["p50"])
        )
        for op in OPERATIONS
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else format_finite(seconds * 1000, ".1f")


def _ops(row: Mapping[str, Any]) -> list[str]:
    return [format_finite(row["ops"][op]["p50"], ".3f") for op in OPERATIONS]


def _load(row: Mapping[str, Any]) -> str:
    return format_finite(row["loadavg"][0], ".2f")


def _growth(section: Mapping[str, Any]) -> str:
    rows = section["rows"]
    if len(rows) < 2:
        return "growth exponent: - (one size)"
    sizes = sorted(row["chunks"] for row in rows)
    parts = ", ".join(f"{op} {format_finite(section['growth'][op], '+.2f')}" for op in OPERATIONS)
    return f"p50 growth exponent {sizes[0]} -> {sizes[-1]} chunks (0: flat, 1: linear): {parts}"


def _bytes(value: float | None) -> str:
    """Bytes per chunk, or ``-`` where they were not measured."""
    return "-" if value is None else format_finite(value, ".0f")


def _cpu(section: Mapping[str, Any]) -> list[str]:
    rows = section["rows"]
    table = format_table(
        [
            *("chunks", "open ms", "1st hit ms", "fill chunk/s", *_OP_HEADERS),
            *("index B/chunk", "resident B/chunk", "load"),
        ],
        [
            [
                str(row["chunks"]),
                _ms(row["open_s"]),
                _ms(row["first_hit_s"]),
                format_finite(row["fill_chunks_per_s"], ".0f"),
                *_ops(row),
                format_finite(row["index_bytes_per_chunk"], ".0f"),
                _bytes(row.get("resident_bytes_per_chunk")),
                _load(row),
            ]
            for row in rows
        ],
    )
    return [
        "CPU tier (RAM): engine open, first RAM hit, requests of 1024 tokens; bytes a chunk "
        "holds beyond its payload (Python's allocations; resident memory, torch's too)",
        table,
    ]


def _disk(section: Mapping[str, Any]) -> list[str]:
    rows = section["rows"]
    opens = []
    for row in rows:
        for name, label in (("no_manifest", "none"), ("manifest", "used")):
            tier, engine = row["tier"][name], row["engine"][name]
            opens.append(
                [
                    str(row["chunks"]),
                    label,
                    _ms(engine["open_s"]),
                    _ms(engine["first_hit_s"]),
                    _ms(tier["open_s"]),
                    _ms(tier["index_s"]),
                    _ms(row["walk_s"]),
                    format_finite(tier["index_over_walk"], ".2f") + "x",
                    str(tier["headers_read"]),
                    _load(row),
                ]
            )
    table = format_table(
        [
            "chunks",
            "manifest",
            "open ms",
            "1st hit ms",
            "tier open ms",
            "index ms",
            "walk ms",
            "index/walk",
            "headers read",
            "load",
        ],
        opens,
    )
    ops = format_table(
        ["chunks", *_OP_HEADERS, "index B/chunk"],
        [
            [str(row["chunks"]), *_ops(row), format_finite(row["index_bytes_per_chunk"], ".0f")]
            for row in rows
        ],
    )
    largest = max(rows, key=lambda row: row["chunks"])
    ratio = largest["tier"]["manifest"]["index_over_walk"]
    met = "met" if ratio <= INDEX_OVER_WALK_TARGET else "not met"
    return [
        "disk tier: engine open and first RAM hit; the tier's open and index complete "
        "(wait_index) beside a names-only walk of the directory",
        table,
        f"target: index complete with the manifest <= {INDEX_OVER_WALK_TARGET:g}x the walk at "
        f"{largest['chunks']} chunks: {format_finite(ratio, '.2f')}x ({met})",
        "the engine's index with the manifest, complete / audited, ms after the open: "
        + ", ".join(
            f"{_ms(row['engine']['manifest']['indexed_s'])} / "
            f"{_ms(row['engine']['manifest']['audited_s'])} ({row['chunks']})"
            for row in rows
        ),
        "disk tier: requests of 1024 tokens (timed once the index is audited)",
        ops,
    ]


def _redis(section: Mapping[str, Any]) -> list[str]:
    rows = section["rows"]
    table = format_table(
        ["keys", "open ms", "1st hit ms", *_OP_HEADERS, "index B/chunk", "server B/key", "load"],
        [
            [
                str(row["chunks"]),
                _ms(row["open_s"]),
                _ms(row["first_hit_s"]),
                *_ops(row),
                row["index"],
                format_finite(row["server_bytes_per_key"], ".0f"),
                _load(row),
            ]
            for row in rows
        ],
    )
    return ["Redis tier (a throwaway redis-server): engine open, first RAM hit, requests", table]


_SECTIONS = {"cpu": _cpu, "disk": _disk, "redis": _redis}


def format_scale(results: Mapping[str, Any]) -> str:
    """A table per tier, each with its growth exponents; the load average at the start
    and with each row ("load": the 1-minute figure after that size); any problem."""
    start = " ".join(format_finite(v, ".2f") for v in results["loadavg_start"])
    layout = results["layout"]
    lines = [
        f"scale: {layout['chunk_bytes']} B chunks of {layout['chunk_tokens']} tokens, "
        f"requests of {layout['request_tokens']} tokens; load average at the start {start}"
    ]
    for tier, section in results["tiers"].items():
        lines += ["", *_SECTIONS[tier](section), _growth(section)]
    lines += [f"problem: {problem}" for problem in results.get("problems", [])]
    return "\n".join(lines)
