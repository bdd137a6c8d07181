"""A capacity sweep: the trace's block-LRU hit rate at each capacity and, when asked, a
replay of the trace against an engine whose tier has that capacity.

With a disk tier the sweep sizes the disk tier (the CPU tier stays as it is); without,
the CPU tier. A capacity of N tokens is ``N // block_size`` chunks; each row gives the bytes
those chunks take for the model shape (KV payload, CPU pool pages, disk records), what a
user must provision for that hit rate.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lmcache_async.bench.trace.bounds import LruBound
from lmcache_async.bench.trace.results import latency_ms, served
from lmcache_async.bench.trace.sizing import ChunkSize
from lmcache_async.bench.trace.targets import Replayed, TierSizes

__all__ = ["SweepReplay", "sweep_replays", "sweep_rows"]

Replay = Callable[[TierSizes, str], Coroutine[Any, Any, tuple[Replayed, dict[str, int | None]]]]
"""Replays the trace at tier sizes (with a progress label); the replay and its tiers'
capacities in chunks."""


@dataclass(slots=True)
class SweepReplay:
    """One capacity's replay: its figures, and the capacity its engine turned out to have."""

    held_blocks: int | None
    figures: dict[str, Any]


async def sweep_replays(
    capacities: Sequence[int],
    *,
    block_size: int,
    cpu_chunks: int | None,
    disk_record: int | None,
    disk: bool,
    replay: Replay,
) -> list[SweepReplay]:
    """Replay the trace once per capacity (tokens), the swept tier of that size."""
    tier = "disk" if disk else "cpu"
    out: list[SweepReplay] = []
    for tokens in capacities:
        blocks = tokens // block_size
        sizes = TierSizes(cpu_chunks, blocks, disk_record) if disk else TierSizes(blocks)
        done, held = await replay(sizes, f"trace replay, {tier} tier of {tokens} tokens")
        figures = {
            **served(done.tally, done.stats),
            "latency_ms": latency_ms(done.tally),
            "wall_seconds": done.wall,
            "evicted_chunks": done.stats.get("evicted_chunks"),
        }
        out.append(SweepReplay(held[tier], figures))
    return out


def sweep_rows(
    capacities: Sequence[int],
    chunk: ChunkSize,
    bounds: Mapping[int, LruBound],
    *,
    disk_record: int | None,
    replays: Sequence[SweepReplay] | None,
) -> list[dict[str, Any]]:
    """One row per capacity (tokens): its bytes for the model shape, the block LRU's
    figures (``bounds``: by capacity in blocks) and, where it was replayed, what the engine
    served with the LRU's hit rate at the capacity it had (``lru_hit_rate``)."""
    rows: list[dict[str, Any]] = []
    for i, tokens in enumerate(capacities):
        blocks = tokens // chunk.tokens
        bound = bounds[blocks]
        replayed: dict[str, Any] | None = None
        if replays is not None:
            run = replays[i]
            replayed = dict(run.figures)
            replayed["capacity_blocks"] = run.held_blocks
            at_held = bounds.get(run.held_blocks) if run.held_blocks is not None else None
            replayed["lru_hit_rate"] = None if at_held is None else at_held.hit_rate
        rows.append(
            {
                "capacity_tokens": tokens,
                "capacity_blocks": blocks,
                "kv_bytes": blocks * chunk.payload,
                "cpu_bytes": chunk.cpu_bytes(blocks),
                "disk_bytes": None if disk_record is None else blocks * disk_record,
                "lru_hit_tokens": bound.hit_tokens,
                "lru_hit_rate": bound.hit_rate,
                "lru_evictions": bound.evictions,
                "served": replayed,
            }
        )
    return rows
