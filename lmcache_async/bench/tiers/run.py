"""Both tier benchmarks in one run, and their text table (``lmcache-async bench --tiers``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

from lmcache_async.bench.tiers.disk import DISK_TARGETS, bench_disk
from lmcache_async.bench.tiers.local import local_redis, tempfile_directory
from lmcache_async.bench.tiers.redis import REDIS_TARGETS, bench_redis

__all__ = ["format_tiers", "run_tiers_bench"]


async def run_tiers_bench(
    *,
    directory: str | os.PathLike[str] | None = None,
    redis_url: str | None = None,
    chunk_bytes: int = 4 << 20,
    chunks: int = 64,
    repeats: int = 3,
) -> dict[str, Any]:
    """Both tier benchmarks: disk in ``directory`` (a temporary one by default), Redis at
    ``redis_url`` or, when none is given, a ``redis-server`` started for the run on a free
    loopback port (skipped, and said so, when redis-server is not installed)."""
    results: dict[str, Any] = {"problems": []}
    if directory is None:
        with tempfile_directory() as tmp:
            results["disk"] = await bench_disk(
                tmp, chunk_bytes=chunk_bytes, chunks=chunks, repeats=repeats
            )
    else:
        results["disk"] = await bench_disk(
            directory, chunk_bytes=chunk_bytes, chunks=chunks, repeats=repeats
        )
    if redis_url is not None:
        results["redis"] = await bench_redis(
            redis_url, chunk_bytes=chunk_bytes, chunks=chunks, repeats=repeats
        )
    elif shutil.which("redis-server") is None:
        results["problems"].append("redis-server is not installed: Redis tier not measured")
    else:
        with tempfile_directory() as tmp, local_redis(tmp) as url:
            results["redis"] = await bench_redis(
                url, chunk_bytes=chunk_bytes, chunks=chunks, repeats=repeats
            )
    for tier, targets in (("disk", DISK_TARGETS), ("redis", REDIS_TARGETS)):
        figures = results.get(tier)
        if figures is None:
            continue
        for name, target in targets.items():
            if figures[name] < target:
                results.setdefault("below_target", []).append(
                    f"{tier} {name} {figures[name]:.2f} < {target}"
                )
    return results


def format_tiers(results: Mapping[str, Any]) -> str:
    """The tier benchmark as a short table, with each ratio next to its target."""
    lines = ["tier   op    GB/s   raw GB/s  ratio  target"]
    rows = (
        ("disk", "put", "put_gbps", "raw_write_gbps", "put_ratio", DISK_TARGETS),
        ("disk", "get", "get_gbps", "raw_read_gbps", "get_ratio", DISK_TARGETS),
        ("redis", "put", "put_gbps", "raw_set_gbps", "put_ratio", REDIS_TARGETS),
        ("redis", "get", "get_gbps", "raw_get_gbps", "get_ratio", REDIS_TARGETS),
    )
    for tier, op, rate, raw, ratio, targets in rows:
        figures = results.get(tier)
        if figures is None:
            continue
        lines.append(
            f"{tier:<6} {op:<4} {figures[rate]:6.2f}   {figures[raw]:6.2f}   "
            f"{figures[ratio]:5.2f}  >= {targets[ratio]}"
        )
    lines.extend(f"note: {problem}" for problem in results.get("problems", []))
    lines.extend(f"below target: {item}" for item in results.get("below_target", []))
    return "\n".join(lines)
