"""The disk tier at one size: a directory of N record files (filled once, kept with
``work_dir``), its names-only walk, the tier's open and index fill without and with a
manifest, and an engine over it: its open, its first RAM hit and its requests.

In order: (1) the engine opened with no manifest, timed to its first RAM hit, and closed
at once (the index still filling); (2) the tier alone, no manifest: open, index complete
(:meth:`DiskBackend.wait_index <lmcache_async.backends.disk.DiskBackend.wait_index>`),
sizes audited, then a clean close, which writes the manifest; (3) the same with that
manifest, ``repeats`` times (the best reported, like the walk's); (4) the engine with the
manifest: open, first RAM hit, and once its index is complete and audited, the requests. The files
the measured stores wrote are deleted after, so the directory holds N files again.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.to_thread
import torch

from lmcache_async import CacheEngine, EngineConfig
from lmcache_async.backends.disk import DiskBackend
from lmcache_async.backends.record import RecordSpec
from lmcache_async.bench.scale.fill import (
    fill_directory,
    names_walk,
    remove_manifest,
    remove_records,
)
from lmcache_async.bench.scale.options import REQUEST_TOKENS
from lmcache_async.bench.scale.requests import MODEL_NAME, ScaleRun, prompt_stream, scale_config
from lmcache_async.memory.pool import MemoryPool

__all__ = ["INDEX_TIMEOUT", "disk_at_size"]

INDEX_TIMEOUT: Final = 300.0
"""Seconds an index fill may take before the run gives up on it."""

_FILE_BYTES: Final = 8192
"""Capacity given to each chunk file (record and slack): the tier never evicts here."""


async def disk_at_size(run: ScaleRun, size: int, directory: Path) -> dict[str, Any]:
    """Every disk figure at ``size`` chunks in ``directory`` (see the module doc)."""
    options, kit, spec = run.options, run.kit, run.spec
    problems: list[str] = []
    row: dict[str, Any] = {"chunks": size}
    label = f"scale disk {size}: writing"
    row["fill"] = await anyio.to_thread.run_sync(
        lambda: fill_directory(
            directory, spec, run.probe_keys, size, stream=run.stream, label=label
        )
    )
    await anyio.to_thread.run_sync(names_walk, directory)  # the page cache warm for all
    walks = []
    for _ in range(options.repeats):
        start = time.perf_counter()
        files = await anyio.to_thread.run_sync(names_walk, directory)
        walks.append(time.perf_counter() - start)
    row["files"] = files
    row["walk_s"] = min(walks)
    if files != size:
        problems.append(f"disk {size}: the walk found {files} files")
    disk_bytes = size * _FILE_BYTES + (64 << 20)
    config = scale_config(run.base, local_disk=str(directory), disk_bytes=disk_bytes)
    engine: dict[str, Any] = {}
    remove_manifest(directory)
    engine["no_manifest"] = await _engine_run(run, config, problems, size=size)
    tier: dict[str, Any] = {}
    remove_manifest(directory)
    tier["no_manifest"] = await _tier_run(directory, spec, disk_bytes)
    runs = [await _tier_run(directory, spec, disk_bytes) for _ in range(options.repeats)]
    tier["manifest"] = min(runs, key=lambda figures: figures["index_s"])
    tier["manifest"]["index_s_runs"] = [figures["index_s"] for figures in runs]
    for name, figures in tier.items():
        figures["index_over_walk"] = figures["index_s"] / row["walk_s"]
        if not figures["complete"] or figures["chunks"] != size:
            problems.append(
                f"disk {size} ({name}): index complete={figures['complete']} with "
                f"{figures['chunks']} chunks"
            )
    fresh = kit.prompts(prompt_stream(options.seed, "disk-fresh", size), options.probes)
    measured = await _engine_run(run, config, problems, size=size, fresh=fresh)
    row["ops"] = measured.pop("ops")
    stored = measured.pop("stored_keys")
    engine["manifest"] = measured
    await anyio.to_thread.run_sync(remove_records, directory, stored)
    row["engine"] = engine
    row["tier"] = tier
    row["index_bytes_per_chunk"] = tier["manifest"]["bytes_per_chunk"]
    row["loadavg"] = os.getloadavg()
    row["problems"] = problems
    return row


async def _tier_run(directory: Path, spec: RecordSpec, disk_bytes: int) -> dict[str, Any]:
    """The tier alone: seconds to open, to a complete index, to audited sizes; then what
    the fill found, and a clean close (which writes the manifest)."""
    pool = MemoryPool(1 << 20, pin_memory=False)
    try:
        start = time.perf_counter()
        disk = await DiskBackend.open(
            directory,
            pool=pool,
            spec=spec,
            allocation_timeout=1.0,
            max_local_disk_size=disk_bytes,
        )
        out: dict[str, Any] = {"open_s": time.perf_counter() - start}
        try:
            with anyio.fail_after(INDEX_TIMEOUT):
                complete = await disk.wait_index()
                out["index_s"] = time.perf_counter() - start
                await disk.wait_index(audited=True)
                out["audited_s"] = time.perf_counter() - start
            stats = disk.index_stats()
        finally:
            await disk.aclose()
    finally:
        pool.close()
    out.update(
        complete=complete,
        chunks=stats.chunks,
        manifest=stats.manifest,
        from_manifest=stats.from_manifest,
        headers_read=stats.headers_read,
        fill_s=stats.seconds,
        bytes_per_chunk=stats.bytes_per_chunk,
    )
    return out


async def _engine_run(
    run: ScaleRun,
    config: EngineConfig,
    problems: list[str],
    *,
    size: int,
    fresh: torch.Tensor | None = None,
) -> dict[str, Any]:
    """An engine over the directory of ``size`` files: seconds to open and to the first
    RAM hit; with ``fresh`` prompts it then waits until its disk index is complete and
    audited, and times the requests (``ops``; ``stored_keys``: the keys the stores
    wrote)."""
    kit = run.kit
    out: dict[str, Any] = {}
    start = time.perf_counter()
    async with CacheEngine.open(config, kit.layout, model_name=MODEL_NAME) as engine:
        out["open_s"] = time.perf_counter() - start
        hit = await kit.first_hit(engine, run.first)
        out["first_hit_s"] = time.perf_counter() - start
        if hit != REQUEST_TOKENS:
            problems.append(f"disk {size}: the first lookup found {hit} of {REQUEST_TOKENS}")
        if fresh is None:
            return out
        with anyio.fail_after(INDEX_TIMEOUT):
            complete = await engine.wait_disk_index()
            out["indexed_s"] = time.perf_counter() - start
            # The audit (a stat of every file the manifest named) runs after the index is
            # complete: the requests are timed once it is over, the steady state.
            await engine.wait_disk_index(audited=True)
            out["audited_s"] = time.perf_counter() - start
        indexed = engine.stats().tiers["disk"].chunks
        if not complete or indexed < size:
            problems.append(f"disk {size}: the engine's index holds {indexed} chunks")
        out["ops"], failed = await kit.measure(
            engine, fresh, run.probes, store_location=["disk"], warmup=run.options.warmup
        )
        problems += [f"disk {size}: {text}" for text in failed]
        out["stored_keys"] = await kit.keys_of(engine, fresh)
    return out
