"""Both tier benchmarks in one run, each tier also with its records encrypted, and their text
table (``lmcache-async bench --tiers``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any, Final

from lmcache_async.bench.tiers.common import ENCRYPTION_TARGETS
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
    encrypted: bool = True,
) -> dict[str, Any]:
    """Both tier benchmarks: disk in ``directory`` (a temporary one by default), Redis at
    ``redis_url`` or, when none is given, a ``redis-server`` started for the run on a free
    loopback port (skipped, and said so, when redis-server is not installed); with
    ``encrypted`` each tier is also measured with its records encrypted."""
    results: dict[str, Any] = {"problems": []}
    sizes: dict[str, Any] = {
        "chunk_bytes": chunk_bytes,
        "chunks": chunks,
        "repeats": repeats,
        "encrypted": encrypted,
    }
    if directory is None:
        with tempfile_directory() as tmp:
            results["disk"] = await bench_disk(tmp, **sizes)
    else:
        results["disk"] = await bench_disk(directory, **sizes)
    if redis_url is not None:
        results["redis"] = await bench_redis(redis_url, **sizes)
    elif shutil.which("redis-server") is None:
        results["problems"].append("redis-server is not installed: Redis tier not measured")
    else:
        with tempfile_directory() as tmp, local_redis(tmp) as url:
            results["redis"] = await bench_redis(url, **sizes)
    for tier in ("disk", "redis"):
        figures = results.get(tier)
        if figures is None:
            continue
        for name, target in figures["targets"].items():
            if figures[name] < target:
                results.setdefault("below_target", []).append(
                    f"{tier} {name} {figures[name]:.2f} < {target}"
                )
    return results


_RAW_RATE: Final[Mapping[tuple[str, str], str]] = {
    ("disk", "put"): "raw_write_gbps",
    ("disk", "get"): "raw_read_gbps",
    ("redis", "put"): "raw_set_gbps",
    ("redis", "get"): "raw_get_gbps",
}


def format_tiers(results: Mapping[str, Any]) -> str:
    """The tier benchmark as a short table, with each ratio next to its target: a tier's
    against the raw I/O of the same bytes, the encrypted tier's (``+aes``) against the
    same tier in the clear."""
    lines = [f"{'tier':<10} {'op':<4} {'GB/s':>5}  {'vs':<5} {'GB/s':>6}  {'ratio':>5}  target"]
    for tier, targets in (("disk", DISK_TARGETS), ("redis", REDIS_TARGETS)):
        figures = results.get(tier)
        if figures is None:
            continue
        for op in ("put", "get"):
            rows = [(tier, f"{op}_gbps", "raw", _RAW_RATE[tier, op], f"{op}_ratio", targets)]
            if f"encrypted_{op}_gbps" in figures:
                rows.append(
                    (
                        f"{tier}+aes",
                        f"encrypted_{op}_gbps",
                        tier,
                        f"{op}_gbps",
                        f"encrypted_{op}_ratio",
                        ENCRYPTION_TARGETS,
                    )
                )
            for label, rate, base, base_rate, ratio, target in rows:
                lines.append(
                    f"{label:<10} {op:<4} {figures[rate]:5.2f}  {base:<5} {figures[base_rate]:6.2f}"
                    f"  {figures[ratio]:5.2f}  >= {target[ratio]}"
                )
    lines.extend(f"note: {problem}" for problem in results.get("problems", []))
    lines.extend(f"below target: {item}" for item in results.get("below_target", []))
    return "\n".join(lines)
