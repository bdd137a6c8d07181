"""The walk over a prefix held across tiers: counting it (a lookup) and reading it (a fetch).

A prompt's leading chunks may sit partly in one tier and continue in another: on CPU,
then on disk, then in Redis, then on CPU again (promoted there, or stored by a later
request). :func:`walk_prefix` asks each source in turn from where the run has got to, and
goes round again while any of them carried it further. A source is not asked again at the
place where it stopped itself, since it would only say no again (to Redis that is one more
round trip): when every source has stopped where the run stands, the walk is done.

:func:`count_prefix` and :func:`read_prefix` are that walk over the tiers a storage
manager chose; which tiers, and whether what is read is promoted, stay the manager's
rules. A slow tier that fails is a miss, reported to ``on_error``, never raised, and is
not asked again in the same walk.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.memory.pool import MemoryObj

from ..errors import TierError
from .base import StorageBackend
from .cpu import CPUBackend

__all__ = [
    "OnError",
    "OnRead",
    "Promote",
    "Source",
    "chunk_keys",
    "count_prefix",
    "read_prefix",
    "walk_prefix",
]

Source = Callable[[int], Awaitable[int]]
"""Given where the run has got to, how many more keys a source supplies from there."""

OnError = Callable[[StorageBackend, TierError], None]
"""Told of a slow tier's failed call (the walk counts it a miss)."""

Promote = Callable[[Sequence[ChunkKey], list[MemoryObj]], None]
"""Given the run a slow tier returned (keys and payloads), keeps it in a faster tier."""

OnRead = Callable[[str, int, float], None]
"""Told of each slow-tier read call: the tier's name, payload bytes returned, seconds."""


async def walk_prefix(
    total: int,
    sources: Sequence[Source],
    *,
    start: int = 0,
    stopped: Sequence[int] = (),
    runs: list[tuple[int, int]] | None = None,
) -> int:
    """The length of the leading run of ``total`` keys that ``sources`` supply together,
    asked in order, round after round.

    ``start``: keys known to be held already (the walk begins after them); ``stopped``:
    the positions in ``sources`` of those known to stop at ``start``, which are not asked
    there. A source's own errors are its to handle: one that cannot answer supplies 0.
    ``runs``, when given, gets ``(source position, keys)`` for each stretch a source
    supplied, in prefix order (the ``start`` keys are not in it).
    """
    at = start
    last: list[int | None] = [start if i in stopped else None for i in range(len(sources))]
    while at < total:
        before = at
        for i, source in enumerate(sources):
            if at == total:
                break
            if last[i] == at:
                continue
            supplied = await source(at)
            if supplied and runs is not None:
                runs.append((i, supplied))
            at += supplied
            last[i] = at
        if at == before:
            break
    return at


def chunk_keys(keys: Sequence[bytes]) -> list[ChunkKey]:
    """Keys as :class:`ChunkKey` (a lookup may probe with bare whole-chunk digests)."""
    return [key if isinstance(key, ChunkKey) else ChunkKey(key) for key in keys]


async def count_prefix(
    keys: Sequence[bytes],
    *,
    cpu: CPUBackend | None,
    slow: Sequence[StorageBackend],
    on_error: OnError,
    cpu_hits: int | None = None,
    runs: list[tuple[str, int]] | None = None,
) -> int:
    """How many leading ``keys`` the CPU tier (None: not read) and the ``slow`` tiers hold
    together (:meth:`~StorageBackend.contains_prefix` on each; a bare digest finds its
    whole-chunk key). ``cpu_hits``: the CPU tier's count of leading ``keys``, already
    taken; the walk starts after it. ``runs``, when given, gets ``(tier name, keys)`` for
    each stretch of the prefix a tier holds, in prefix order."""
    names = ([] if cpu is None else [cpu.name]) + [tier.name for tier in slow]
    sources: list[Source] = [] if cpu is None else [_cpu_count(cpu, keys)]
    if slow:
        as_keys = chunk_keys(keys)
        sources += [_slow_count(tier, as_keys, on_error) for tier in slow]
    found: list[tuple[int, int]] | None = None if runs is None else []
    if cpu is None or cpu_hits is None:
        held = await walk_prefix(len(keys), sources, runs=found)
    else:
        if runs is not None and cpu_hits:
            runs.append((cpu.name, cpu_hits))
        held = await walk_prefix(len(keys), sources, start=cpu_hits, stopped=(0,), runs=found)
    if runs is not None and found is not None:
        runs.extend((names[i], count) for i, count in found)
    return held


async def read_prefix(
    keys: Sequence[ChunkKey],
    *,
    pinned: Mapping[bytes, MemoryObj] | None,
    cpu: CPUBackend | None,
    slow: Sequence[StorageBackend],
    promote: Promote,
    on_error: OnError,
    on_read: OnRead | None = None,
) -> list[MemoryObj]:
    """The payloads of the longest leading run of ``keys`` that ``pinned`` (objects kept
    for the caller; a freed one is a miss), the CPU tier (None: not read) and the ``slow``
    tiers return together, each referenced for the caller. Slow tiers are read with
    :meth:`~StorageBackend.get_prefix` from where the run stands, and what they return is
    handed to ``promote``; each such read call that answered is reported to ``on_read``
    (a miss too, with 0 bytes). Should the walk fail (a closed tier or pool) or be
    cancelled, what it read is released."""
    out: list[MemoryObj] = []
    sources: list[Source] = [_pins_read(pinned, keys, out)] if pinned else []
    if cpu is not None:
        sources.append(_cpu_read(cpu, keys, out))
    sources += [_slow_read(tier, keys, out, promote, on_error, on_read=on_read) for tier in slow]
    try:
        await walk_prefix(len(keys), sources)
    except BaseException:
        for obj in out:
            obj.unref()
        raise
    return out


# -- the sources: how each place answers "how many more from here" ----------------------


def _cpu_count(cpu: CPUBackend, keys: Sequence[bytes]) -> Source:
    async def count(at: int) -> int:
        return cpu.contains_prefix_nowait(keys[at:])

    return count


def _slow_count(tier: StorageBackend, keys: Sequence[ChunkKey], on_error: OnError) -> Source:
    failed = False

    async def count(at: int) -> int:
        nonlocal failed
        if failed:
            return 0
        try:
            return await tier.contains_prefix(keys[at:])
        except TierError as exc:
            failed = True
            on_error(tier, exc)
            return 0

    return count


def _pins_read(
    pinned: Mapping[bytes, MemoryObj], keys: Sequence[ChunkKey], out: list[MemoryObj]
) -> Source:
    async def read(at: int) -> int:
        for key in keys[at:]:
            obj = pinned.get(key)
            if obj is None or obj.freed:
                break
            out.append(obj.ref())
        return len(out) - at

    return read


def _cpu_read(cpu: CPUBackend, keys: Sequence[ChunkKey], out: list[MemoryObj]) -> Source:
    async def read(at: int) -> int:
        out.extend(cpu.get_prefix_nowait(keys[at:]))
        return len(out) - at

    return read


def _slow_read(
    tier: StorageBackend,
    keys: Sequence[ChunkKey],
    out: list[MemoryObj],
    promote: Promote,
    on_error: OnError,
    *,
    on_read: OnRead | None,
) -> Source:
    failed = False

    async def read(at: int) -> int:
        nonlocal failed
        if failed:
            return 0
        began = time.perf_counter()
        try:
            run = await tier.get_prefix(keys[at:])
        except TierError as exc:
            failed = True
            on_error(tier, exc)
            return 0
        if on_read is not None:
            on_read(tier.name, sum(obj.nbytes for obj in run), time.perf_counter() - began)
        if run:
            promote(keys[at : at + len(run)], run)
        out.extend(run)
        return len(run)

    return read
