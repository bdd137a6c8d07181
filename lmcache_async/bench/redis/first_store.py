"""The first-store part of ``bench --redis``: a fresh engine's first store of the request
beside its steady-state stores, with the pool's prefault on and off.

Each trial opens a new engine with a RAM tier only (a new arena, so pages the process has
never written), stores the request once (the *first* store), then empties the tier and
stores it again :data:`STEADY_STORES` times into the same pages, now resident (the
*steady* store: their median). Three kinds of engine, taking turns trial by trial so that
a noisy neighbour weighs on each alike:

- ``off``: ``prefault_pool=False``, each page faulted in by the store that first writes it;
- ``on``: ``prefault_pool=True`` (the default), the store issued as soon as ``open``
  returns, racing the worker that faults the pages in behind it;
- ``on_done``: as ``on``, the store issued once that worker is done.

One engine of each kind is opened and stored into first, uncounted (imports, thread pools,
code paths). Each trial also times the plain floor (:func:`plain_fault_in`): the request's
bytes written into a fresh anonymous mapping (huge pages asked for, as the pool does), then
into the same pages again, so the machine's own cost of first touching that much memory
is printed beside the engines'.
"""

from __future__ import annotations

import mmap
import statistics
import time
from collections.abc import Callable
from typing import Any, Final, TextIO

import anyio
import anyio.to_thread
import numpy as np
import torch

from lmcache_async import CacheEngine, EngineConfig
from lmcache_async.bench.baselines import slots_over
from lmcache_async.bench.redis.options import MODEL_NAME, RedisBenchOptions
from lmcache_async.config import GB
from lmcache_async.memory.prefault import advise_huge_pages

__all__ = ["KINDS", "STEADY_STORES", "measure_first_stores", "plain_fault_in", "pool_bytes"]

KINDS: Final = ("off", "on", "on_done")
"""The engines compared: prefault off, on (the store racing it), on and done."""

STEADY_STORES: Final = 5
"""Stores into resident pages after the first, per trial (their median is its steady)."""

_MIN_POOL: Final = 256 << 20
_PREFAULT_WAIT: Final = 120.0
_VOCAB: Final = 32000
_HUGE_PAGE: Final = 2 << 20


def pool_bytes(options: RedisBenchOptions) -> int:
    """Each fresh engine's arena: 256 MiB, or four requests when that is more."""
    return max(_MIN_POOL, 4 * options.request_bytes)


def plain_fault_in(
    nbytes: int, on_written: Callable[[int], None] | None = None
) -> tuple[float, float]:
    """Seconds for one thread to write ``nbytes`` into a fresh anonymous mapping (each page
    faulted in by the write, huge pages asked for as the pool asks), then into the same
    pages again (resident). ``on_written(address)`` runs between the two writes (tests
    look at the mapping there). Blocking: run in a thread.

    The mapping is private, as the pool's host memory is (``mmap``'s default for an
    anonymous map is shared memory, which gets huge pages only where the kernel's
    ``shmem_enabled`` says so)."""
    with mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as fresh:
        whole = np.frombuffer(fresh, dtype=np.uint8)
        skip = -whole.ctypes.data % _HUGE_PAGE  # start on a huge-page boundary
        view = whole[skip : skip + nbytes]
        advise_huge_pages(torch.from_numpy(view))
        began = time.perf_counter()
        view.fill(1)
        first = time.perf_counter() - began
        if on_written is not None:
            on_written(view.ctypes.data)
        began = time.perf_counter()
        view.fill(2)
        again = time.perf_counter() - began
        del view, whole  # the mapping closes only once no view is left on it
    return first, again


async def measure_first_stores(
    options: RedisBenchOptions, base: EngineConfig, progress: TextIO | None = None
) -> dict[str, Any]:
    """Run ``options.rounds`` trials of each kind; returns per kind ``first_s`` and
    ``steady_s`` (a list over the trials each), ``plain`` (the same two of
    :func:`plain_fault_in` of the request's bytes, per trial), ``pool_bytes`` and
    ``problems``.

    Raises:
        ConfigError: the engine refuses the settings.
        TimeoutError: a store took longer than ``timeout``.
    """
    layout = options.layout()
    blocks = -(-options.tokens // layout.block_size)
    source = layout.allocate_kv_caches(
        blocks, generator=torch.Generator().manual_seed(options.seed), random=True
    )
    slots = slots_over(torch.arange(blocks, dtype=torch.int64), layout.block_size, options.tokens)
    tokens = torch.randint(
        0, _VOCAB, (options.tokens,), generator=torch.Generator().manual_seed(options.seed + 1)
    )
    arena = pool_bytes(options)
    config = base.replace(
        chunk_size=options.chunk_tokens,
        local_cpu=True,
        max_local_cpu_size=arena / GB,
        local_disk=None,
        remote_url=None,
        store_location=None,
        retrieve_locations=None,
        use_layerwise=False,
        tenant_quotas=None,
    )
    problems: list[str] = []

    async def trial(kind: str) -> tuple[float, float]:
        """One fresh engine of ``kind``: its first store and its median steady store."""
        cfg = config.replace(prefault_pool=kind != "off")
        async with CacheEngine.open(cfg, layout, model_name=MODEL_NAME) as engine:
            worker = engine.core.pool.prefaulting
            if kind == "on_done" and worker is not None:
                await anyio.to_thread.run_sync(worker.join, _PREFAULT_WAIT)
            times = []
            for _ in range(1 + STEADY_STORES):
                await engine.clear()
                with anyio.fail_after(options.timeout):
                    began = time.perf_counter()
                    stored = await engine.store(tokens, kv_caches=source, slot_mapping=slots)
                    times.append(time.perf_counter() - began)
                if stored != options.tokens:
                    problems.append(f"first stores, {kind}: stored {stored} of {options.tokens}")
        return times[0], statistics.median(times[1:])

    figures: dict[str, dict[str, list[float]]] = {k: {"first_s": [], "steady_s": []} for k in KINDS}
    plain: dict[str, list[float]] = {"first_s": [], "steady_s": []}
    for kind in KINDS:  # warm-up, uncounted
        await trial(kind)
    for t in range(options.rounds):
        if progress is not None:
            print(f"bench: redis first stores, trial {t + 1}/{options.rounds}", file=progress)
        for kind in KINDS:
            first, steady = await trial(kind)
            figures[kind]["first_s"].append(first)
            figures[kind]["steady_s"].append(steady)
        first, steady = await anyio.to_thread.run_sync(plain_fault_in, options.request_bytes)
        plain["first_s"].append(first)
        plain["steady_s"].append(steady)
    return {"kinds": figures, "plain": plain, "pool_bytes": arena, "problems": problems}
