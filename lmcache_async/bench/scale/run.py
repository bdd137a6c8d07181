"""A whole scale run: the work directory, the probe prompts and their keys, each tier at
each size, smallest first, and the growth of each operation's cost."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final, TextIO

import torch

from lmcache_async import CacheEngine, EngineConfig
from lmcache_async.bench.scale.cpu import cpu_at_size
from lmcache_async.bench.scale.disk import disk_at_size
from lmcache_async.bench.scale.options import CHUNK_TOKENS, REQUEST_TOKENS, ScaleOptions
from lmcache_async.bench.scale.redis import redis_at_size
from lmcache_async.bench.scale.report import growth_exponents
from lmcache_async.bench.scale.requests import (
    MODEL_NAME,
    RequestKit,
    ScaleRun,
    prompt_stream,
    scale_config,
)
from lmcache_async.bench.tiers.local import local_redis, tempfile_directory
from lmcache_async.engine.tiers import record_cipher, record_spec
from lmcache_async.keys.chunks import ChunkKey

__all__ = ["run_scale_bench"]


def _say(stream: TextIO | None, text: str) -> None:
    if stream is not None:
        print(f"bench: scale {text}", file=stream, flush=True)


@contextlib.contextmanager
def _work_dir(options: ScaleOptions) -> Iterator[Path]:
    """``options.work_dir`` (created, kept), or a temporary directory removed after."""
    if options.work_dir is not None:
        path = Path(options.work_dir)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile_directory() as tmp:
        yield Path(tmp)


async def _probe_keys(base: EngineConfig, kit: RequestKit, probes: torch.Tensor) -> list[ChunkKey]:
    """The keys the measured engines give the probe prompts (asked of an engine with the
    same settings and no slow tier)."""
    async with CacheEngine.open(scale_config(base), kit.layout, model_name=MODEL_NAME) as engine:
        return await kit.keys_of(engine, probes)


async def run_scale_bench(
    options: ScaleOptions,
    config: EngineConfig | None = None,
    *,
    progress_stream: TextIO | None = sys.stderr,
) -> dict[str, Any]:
    """Measure each tier of ``options.tiers`` at each size (see
    :mod:`lmcache_async.bench.scale`) and return every figure as plain data. ``config``
    gives the settings the benchmark does not fix (the tier codec, encryption, timeouts);
    progress goes to ``progress_stream`` (None: nowhere).

    Raises:
        InvalidInputError: the options are invalid, or redis-server does not start.
        ConfigError: the engine refuses ``config`` with the benchmark's settings.
    """
    options.validate()
    base = config if config is not None else EngineConfig()
    kit = RequestKit(options.seed)
    probes = kit.prompts(prompt_stream(options.seed, "probes"), options.probes)
    results: dict[str, Any] = {
        "options": options.as_dict(),
        "layout": {
            "chunk_tokens": CHUNK_TOKENS,
            "chunk_bytes": kit.chunk_bytes,
            "request_tokens": REQUEST_TOKENS,
            "fingerprint": kit.layout.fingerprint,
        },
        "loadavg_start": os.getloadavg(),
        "tiers": {},
        "problems": [],
    }
    problems: list[str] = results["problems"]
    keys: list[ChunkKey] = []
    if "disk" in options.tiers or "redis" in options.tiers:
        keys = await _probe_keys(base, kit, probes)
    run = ScaleRun(
        options=options,
        base=base,
        kit=kit,
        spec=record_spec(scale_config(base), kit.layout, cipher=record_cipher(base)),
        first=kit.prompts(prompt_stream(options.seed, "first-hit"), 1)[0],
        probes=probes,
        probe_keys=keys,
        stream=progress_stream,
    )
    with _work_dir(options) as work:
        for tier in options.tiers:
            if tier == "redis" and shutil.which("redis-server") is None:
                problems.append("redis-server is not installed: the Redis tier was not measured")
                continue
            rows = await _TIERS[tier](run, work)
            for row in rows:
                problems += row.pop("problems")
            results["tiers"][tier] = {
                "rows": rows,
                "growth": growth_exponents(rows),
                "loadavg": os.getloadavg(),
            }
    return results


async def _cpu_rows(run: ScaleRun, work: Path) -> list[dict[str, Any]]:
    """The CPU tier at each size, a fresh engine each."""
    rows = []
    for size in run.options.ordered_sizes():
        _say(run.stream, f"cpu {size} chunks")
        rows.append(await cpu_at_size(run, size))
    return rows


async def _disk_rows(run: ScaleRun, work: Path) -> list[dict[str, Any]]:
    """The disk tier at each size, a directory each (``work/disk-<size>``)."""
    rows = []
    for size in run.options.ordered_sizes():
        _say(run.stream, f"disk {size} chunks")
        rows.append(await disk_at_size(run, size, work / f"disk-{size}"))
    return rows


async def _redis_rows(run: ScaleRun, work: Path) -> list[dict[str, Any]]:
    """The Redis tier at each size, one throwaway server grown from size to size."""
    rows = []
    redis_dir = work / "redis"
    redis_dir.mkdir(exist_ok=True)
    with local_redis(str(redis_dir)) as url:
        filled = 0
        for size in run.options.ordered_sizes():
            _say(run.stream, f"redis {size} keys")
            rows.append(await redis_at_size(run, size, url, filled))
            filled = size
    return rows


_TIERS: Final[Mapping[str, Callable[[ScaleRun, Path], Awaitable[list[dict[str, Any]]]]]] = {
    "cpu": _cpu_rows,
    "disk": _disk_rows,
    "redis": _redis_rows,
}
